"""Jepsen-style fault suite: confirmed messages survive kills, pauses, cut links and failovers.

Producers (publisher confirms, numbered messages) and consumers (acks) run
against a replicated pair while a nemesis kills the active with `kill -9` and
promotes the passive through the admin API, SIGSTOPs either broker, cuts or
partitions the replication link, and restarts the passive in the middle of a
catch-up. After a final drain the checker must find no confirmed message lost
and nothing unexpected; duplicates are counted and printed.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
from jepsen import FAULTS, Pair, Report, check, decode_body, encode_body, run_suite

# -- the checker on its own ---------------------------------------------------------------


def test_checker_clean_run() -> None:
    sent = {"p0": {0, 1, 2}, "p1": {0, 1}}
    confirmed = {"p0": {0, 1}, "p1": {0, 1}}
    received = [encode_body("p0", n) for n in (0, 1, 2)] + [encode_body("p1", n) for n in (0, 1)]
    verdict = check(sent, confirmed, received)
    assert verdict.ok
    assert (verdict.sent, verdict.confirmed, verdict.received, verdict.deliveries) == (5, 4, 5, 5)
    assert verdict.lost == [] and verdict.duplicates == {}
    assert verdict.recovered == 1  # p0:2 made it although its confirm never came


def test_checker_finds_a_lost_confirmed_message() -> None:
    verdict = check({"p0": {0, 1, 2}}, {"p0": {0, 1}}, [encode_body("p0", 0)])
    assert not verdict.ok
    assert verdict.lost == [("p0", 1)]


def test_checker_unconfirmed_and_missing_is_not_lost() -> None:
    verdict = check({"p0": {0, 1}}, {"p0": {0}}, [encode_body("p0", 0)])
    assert verdict.ok and verdict.lost == []


def test_checker_finds_unexpected_messages() -> None:
    received = [encode_body("p0", 0), encode_body("p0", 7), encode_body("ghost", 0), b"garbage"]
    verdict = check({"p0": {0}}, {"p0": {0}}, received)
    assert not verdict.ok
    assert verdict.unexpected == received[1:]


def test_checker_counts_duplicates() -> None:
    received = [encode_body("p0", n) for n in (0, 1, 1, 1, 2, 0)]
    verdict = check({"p0": {0, 1, 2}}, {"p0": {0, 1, 2}}, received)
    assert verdict.ok
    assert verdict.duplicates == {("p0", 0): 1, ("p0", 1): 2}
    assert verdict.duplicate_count == 3
    assert verdict.deliveries == 6 and verdict.received == 3
    assert "duplicates 3 (of 2 messages)" in verdict.summary()


def test_bodies_round_trip() -> None:
    assert decode_body(encode_body("p3", 42, padding=10)) == ("p3", 42)
    assert decode_body(b"p3:42:xxy") is None
    assert decode_body(b"nonsense") is None


# -- the pair under faults ----------------------------------------------------------------


def _run(tmp_path: Path, faults: list[str], seed: int, **workload: object) -> Report:
    with Pair(tmp_path, replication_timeout=1.0) as pair:
        report = asyncio.run(run_suite(pair, faults, seed, **workload))
    print()
    print(report.text())
    print("\n".join(report.events[-40:]))
    return report


def _assert_sound(report: Report) -> None:
    verdict = report.verdict
    assert not verdict.lost, f"confirmed messages lost: {verdict.lost[:50]}"
    assert not verdict.unexpected, f"unexpected messages: {verdict.unexpected[:20]}"
    assert verdict.confirmed > 0
    assert report.passive_left == (0, 0), "the passive did not follow every dequeue"


@pytest.mark.timeout(180)
def test_every_fault_once(tmp_path: Path) -> None:
    """Each fault once (a few cycles, well under a minute on a quiet machine)."""
    report = _run(tmp_path, list(FAULTS), seed=1)
    _assert_sound(report)
    assert report.nemesis.cycles == len(FAULTS)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(7200)
def test_long_run_random_faults(tmp_path: Path) -> None:
    """At least 100 fault cycles, drawn at random (seed from TWINMQ_FAULT_SEED or random)."""
    seed = int(os.environ.get("TWINMQ_FAULT_SEED", random.randrange(1 << 30)))
    cycles = int(os.environ.get("TWINMQ_FAULT_CYCLES", "120"))
    rng = random.Random(seed)
    faults = [rng.choice(FAULTS) for _ in range(cycles)]
    print(f"\nseed {seed}")
    report = _run(tmp_path, faults, seed=seed)
    _assert_sound(report)
    assert report.nemesis.cycles == len(faults)
