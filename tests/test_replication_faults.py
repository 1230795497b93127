"""Jepsen-style fault suite: confirmed messages survive kills, pauses, cut links and failovers.

Producers (publisher confirms, numbered messages; transactional ones in the
fault matrix) and consumers (acks) run against a replicated pair while a
nemesis kills the active with `kill -9` and promotes the passive through the
admin API, SIGSTOPs either broker, cuts or partitions the replication link,
restarts the passive in the middle of a catch-up, fills a broker's disk,
flips a bit in a journal segment or jumps a broker's clock. After a final
drain the checker must find no confirmed (or commit-ok'd) message lost and
nothing unexpected; duplicates are counted and printed.

The fault matrix (docs/reliability.md) runs each fault class on a pair of its
own; every cycle must prove that its fault hit the path it targets. One or two
cycles per class run here; `make faults` runs TWINMQ_FAULT_CYCLES per class.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import random
import subprocess
import time
from pathlib import Path

import pytest
from jepsen import (
    FAULTS,
    MATRIX,
    ClassResult,
    FaultClass,
    Report,
    Unavailable,
    Workload,
    check,
    decode_body,
    encode_body,
    run_class,
    run_suite,
    wait_for,
    write_results,
)

from twinmq.testing.pair import Pair

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


def test_a_nacked_or_rolled_back_message_that_was_delivered_is_counted() -> None:
    load = Workload(["127.0.0.1:1"], producers=1, tx_producers=1, consumers=1)
    confirming, transactional = load.producers
    confirming.log.nacked = {3}
    transactional.log.rolled_back = {5, 6}
    load.consumers[0].received = [
        encode_body("p0", 3), encode_body("t0", 6), encode_body("p0", 4), b"garbage"
    ]  # fmt: skip
    assert load.failed_delivered() == {("p0", 3), ("t0", 6)}


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


@pytest.mark.soak  # `make test` runs each fault class on its own (the matrix below)
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


# -- the fault matrix ---------------------------------------------------------------------


def _run_class(
    tmp_path: Path, fault_class: FaultClass, cycles: int, seed: int, backlog: int | None = None
) -> ClassResult:
    try:
        result, report = run_class(tmp_path, fault_class, cycles, seed, backlog=backlog)
    except Unavailable as exc:
        pytest.skip(f"{fault_class.name}: {exc}")
    print(f"\n{fault_class.name} (seed {seed}): {report.text()}")
    print(f"proofs: {result.proofs}; back to ready p50 {result.ready_p50:.1f}s")
    print("\n".join(report.events[-30:]))
    return result


def _assert_class_sound(result: ClassResult) -> None:
    assert not result.lost, f"confirmed messages lost: {result.lost_sample}"
    assert not result.unexpected, "messages received that were never sent"
    assert result.confirmed > 0 and result.commits > 0, "confirms and commits must flow"
    assert result.hits == result.cycles, f"faults that missed their path: {result.misses}"
    assert result.passive_left == (0, 0), "the passive did not follow every dequeue"
    assert not result.poison_wrong, f"poison not refused as documented: {result.poison_wrong}"
    assert not result.failed_delivered, "nacked or rolled-back messages were delivered"


# The short matrix's huge backlog: still a catch-up of 15 chunks (4096 messages each).
SHORT_BACKLOG = 60_000


# Each family's faults once (corruption: the passive, and the old active after a failover).
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "fault_class", [pytest.param(c, id=c.name) for c in MATRIX]
)  # fmt: skip
def test_each_fault_class_hits_its_path_and_loses_no_confirmed_message(
    tmp_path: Path, fault_class: FaultClass
) -> None:
    backlog = min(fault_class.backlog, SHORT_BACKLOG)
    result = _run_class(tmp_path, fault_class, len(fault_class.faults), seed=11, backlog=backlog)
    _assert_class_sound(result)


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        )  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
            text=True, check=True, cwd=Path(__file__).parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + (" (uncommitted changes)" if dirty else "")


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.faults
@pytest.mark.timeout(0)
def test_fault_matrix(tmp_path: Path) -> None:
    """TWINMQ_FAULT_CYCLES (100) cycles per fault class; the table goes to
    TWINMQ_FAULT_RESULTS (.cache/faults/matrix-<time>) as .json and .md.
    TWINMQ_FAULT_CLASSES (comma-separated) runs only those classes. The brokers' logs and
    the events of a class that fails (of every class with TWINMQ_FAULT_KEEP_LOGS=1) are
    kept in <results>-<class>-logs/."""
    cycles = int(os.environ.get("TWINMQ_FAULT_CYCLES", "100"))
    seed = int(os.environ.get("TWINMQ_FAULT_SEED", random.randrange(1 << 30)))
    wanted = os.environ.get("TWINMQ_FAULT_CLASSES")
    classes = [c for c in MATRIX if not wanted or c.name in wanted.split(",")]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    default = Path(__file__).parent.parent / ".cache" / "faults" / f"matrix-{stamp}"
    path = Path(os.environ.get("TWINMQ_FAULT_RESULTS", default))
    header = (
        f"{cycles} cycles per class, seed {seed}, commit {_git_commit()}, "
        f"{stamp}, {os.cpu_count()} cores, Python {platform.python_version()}\n"
    )
    print(f"\nfault matrix: {header}results: {path}.json and {path}.md")
    results: list[ClassResult] = []
    skipped: list[str] = []
    errors: dict[str, str] = {}  # classes that did not finish: the next ones still run
    for i, fault_class in enumerate(classes):
        started = time.monotonic()
        try:
            result, report = run_class(
                tmp_path / fault_class.name, fault_class, cycles, seed + i,
                keep=path.with_name(f"{path.name}-{fault_class.name}-logs"),
                keep_always=os.environ.get("TWINMQ_FAULT_KEEP_LOGS") == "1",
            )  # fmt: skip
        except Unavailable as exc:
            skipped.append(f"{fault_class.name}: {exc}")
            continue
        except Exception as exc:
            errors[fault_class.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            write_results(results, path, header, errors)
            print(f"{fault_class.name}: DID NOT FINISH: {exc}")
            continue
        results.append(result)
        write_results(results, path, header, errors)  # after each class: a partial run is kept
        print(
            f"{fault_class.name}: {result.cycles} cycles in {time.monotonic() - started:.0f}s, "
            f"hits {result.hits}, confirmed {result.confirmed}, lost {result.lost}, "
            f"duplicates {result.duplicates}, proofs {result.proofs}, nacked or rolled back "
            f"but delivered {result.failed_delivered}, most ready at a cycle's start "
            f"{result.max_depth}"
        )
        if not result.ok:
            print(report.text())
            print("\n".join(report.events))  # what each missed cycle did
    print(f"\nresults: {path}.json and {path}.md")
    print(path.with_suffix(".md").read_text() if results else "no class ran")
    if skipped:
        print("skipped: " + "; ".join(skipped))
    assert not errors, f"fault classes that did not finish: {errors}"
    for result in results:
        _assert_class_sound(result)


@pytest.mark.timeout(240)
def test_ten_thousand_unconfirmed_publishes_and_a_commit_in_flight_survive_a_failover(
    tmp_path: Path,
) -> None:
    """A publisher with 10,000 messages unconfirmed (and a transaction of 10,000 being
    committed) when the active is killed: the link is partitioned until the window is
    full (the active holds every confirm for its passive), healed, and the active is
    killed at once, while the passive's acknowledgements and the confirms they release
    are on their way. Nothing confirmed may be lost, nothing delivered that a nack or a
    541 refused."""
    with Pair(tmp_path, replication_timeout=10.0) as pair:

        async def attack() -> tuple[int, Workload]:
            load = Workload(
                pair.amqp_addresses, producers=1, tx_producers=1, consumers=1,
                window=10_000, interval=0.0,
            )  # fmt: skip
            load.start()
            await asyncio.to_thread(wait_for, "confirms", lambda: load.confirmed > 1000, 30)
            pair.link.partition()
            producer = load.producers[0]
            outstanding = await asyncio.to_thread(
                wait_for,
                "9,000 unconfirmed",
                lambda: (n := len(producer._outstanding)) >= 9_000 and n,
                8,
                0.01,
            )
            pair.link.heal()
            promoted = await asyncio.to_thread(pair.failover)
            assert promoted, "the passive was not ready: no failover happened"
            before = load.confirmed
            await asyncio.to_thread(wait_for, "more", lambda: load.confirmed > before + 1000, 60)
            await load.finish(pair)
            return outstanding, load

        outstanding, load = asyncio.run(attack())
    verdict = load.verdict()
    print(f"\n{outstanding} unconfirmed at the kill; {verdict.summary()}")
    assert outstanding >= 9_000
    assert not verdict.lost, f"confirmed messages lost: {verdict.lost[:50]}"
    assert not verdict.unexpected, f"unexpected messages: {verdict.unexpected[:20]}"
    assert load.failed_delivered() == set()
    assert load.passive_left == (0, 0), "the passive did not follow every dequeue"
