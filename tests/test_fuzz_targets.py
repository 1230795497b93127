"""The fuzz targets of `make fuzz` stay sound: every seed passes, every past finding passes.

A finding of the fuzzer is copied to `fuzz/regressions/<target>/` once fixed; replaying
it here keeps it fixed. The seeds must pass too, or the fuzzer would start from a crash.
A few hundred deterministic mutations of the seeds per target keep the targets' own
checks honest between fuzzing campaigns (the campaigns are `make fuzz`, not unit tests).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from twinmq.fuzz.targets import TARGETS, regressions

REGRESSIONS = Path(__file__).resolve().parent.parent / "fuzz" / "regressions"

# Fuzzed frames decode to basic.recover-async now and then, which pamqp warns about.
pytestmark = pytest.mark.filterwarnings("ignore:This command is deprecated:DeprecationWarning")


def _mutations(seed: bytes, rng: random.Random, count: int) -> list[bytes]:
    """Byte flips, cuts and insertions of `seed`, as libFuzzer's simplest mutators make."""
    out = []
    for _ in range(count):
        data = bytearray(seed)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(data) + 1)
            kind = rng.randrange(3)
            if kind == 0 and pos < len(data):
                data[pos] ^= 1 << rng.randrange(8)
            elif kind == 1:
                del data[pos : pos + rng.randint(1, 8)]
            else:
                data[pos:pos] = rng.randbytes(rng.randint(1, 8))
        out.append(bytes(data))
    return out


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_seed_passes_its_target(name: str) -> None:
    target = TARGETS[name]
    seeds = target.seeds()
    assert seeds, f"{name} has no seed"
    for seed in seeds:
        target.one_input(seed)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_past_finding_stays_fixed(name: str) -> None:
    for path in regressions(REGRESSIONS, name):
        TARGETS[name].one_input(path.read_bytes())


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_mutated_seeds_pass_their_target(name: str) -> None:
    target = TARGETS[name]
    rng = random.Random(name)
    seeds = target.seeds()
    slow = name in ("amqp_connection", "admin_api")  # a virtual host or an HTTP server each
    per_seed = max(1, (20 if slow else 400) // len(seeds))
    for seed in seeds:
        for data in _mutations(seed, rng, per_seed):
            target.one_input(data)


def test_every_regression_folder_names_a_target() -> None:
    folders = {p.name for p in REGRESSIONS.iterdir() if p.is_dir()}
    assert folders <= set(TARGETS), folders - set(TARGETS)
