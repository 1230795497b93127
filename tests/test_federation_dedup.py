"""The dedup window's compacted keys (sans-I/O): a bit per seq from a rising floor, exact
while a link lags far past `dedup-window`, bounded, and rebuilt from the journal."""

from __future__ import annotations

from pathlib import Path

from twinmq.broker.federation.dedup import QUEUE_NAME, SPAN, DurableKeys, LagWindow
from twinmq.broker.federation.seqbits import SeqBits
from twinmq.testing.sansio import Harness


def key(origin: str, seq: int) -> str:
    """A dedup key as `headers.arrival` makes it."""
    return f"{origin}\x00{seq}"


def test_seqbits_holds_sparse_seqs_exactly_and_trims_below_a_floor() -> None:
    bits = SeqBits()
    seen = [1003, 1007, 1010, 1500, 999]  # the last below the first base: grows downward
    for seq in seen:
        bits.add(seq)
    bits.add(1007)  # twice: counted once
    assert [seq for seq in range(990, 1510) if seq in bits] == sorted(seen)
    assert len(bits) == 5
    assert bits.trim(1008) == 3  # 999, 1003, 1007: mid-byte floors are exact too
    assert [seq for seq in range(990, 1510) if seq in bits] == [1010, 1500]
    assert bits.span <= 1500 - 1008 + 8  # the memory follows the floor up


def test_seqbits_snapshot_reads_back_the_same_set() -> None:
    bits = SeqBits()
    for seq in range(5, 400, 7):
        bits.add(seq)
    again = SeqBits.decode(bits.encode())
    assert again is not None
    assert [s for s in range(500) if s in again] == [s for s in range(500) if s in bits]
    merged = SeqBits()
    merged.add(1)
    merged.union(again)
    assert len(merged) == len(bits) + 1
    assert SeqBits.decode("not a snapshot") is None


def test_a_link_lagging_a_hundred_times_the_window_still_finds_every_key() -> None:
    """The case the former 10x stretch lost: 2,000 keys of a window of 10 while the link
    via b has passed nothing; every one is still known, in a few hundred bytes."""
    window = LagWindow(size=10)
    window.register("direct")
    window.register("via-b")
    for seq in range(0, 10_000, 5):  # an origin's seqs interleave with its other IDs
        window.add(key("a", seq))
        window.passed("direct", [key("a", seq)])
    assert all(key("a", seq) in window for seq in range(0, 10_000, 5))
    assert not any(key("a", seq) in window for seq in range(1, 10_000, 5))  # never came
    assert window.forced == 0
    assert window.lagged_bytes <= 10_000 // 8 + 1
    window.passed("via-b", [key("a", seq) for seq in range(0, 5_000, 5)])
    assert window.lagged["a"].span <= 5_000 + 16  # the floor rose with the slowest link
    assert all(key("a", seq) in window for seq in range(5_000, 10_000, 5))


def test_the_lagged_keys_are_bounded_and_what_is_forced_out_is_counted() -> None:
    window = LagWindow(size=1)
    window.register("direct")
    window.register("gone")  # down for good: never passes anything
    for seq in (0, SPAN // 2, SPAN + 8, 2 * SPAN):
        window.add(key("a", seq))
    assert sum(bits.span for bits in window.lagged.values()) <= SPAN
    assert window.forced > 0
    assert key("a", 2 * SPAN) in window  # the newest are kept


def test_an_origins_id_jump_forgets_what_is_too_old_instead_of_allocating_the_gap() -> None:
    """An origin's IDs jump by 2^40 when its pair fails over (a new epoch's range): a
    bitmap across the jump would be 128 GiB. The older seqs are forgotten (counted), the
    span stays within the bound, and a key far below the span is not kept."""
    window = LagWindow(size=10)
    window.register("direct")
    window.register("gone")  # never passes anything: every key is kept as lagged
    for seq in range(0, 200, 5):
        window.add(key("a", seq))
    jumped = 1 << 40
    for seq in range(jumped, jumped + 200, 5):
        window.add(key("a", seq))
    assert window.lagged["a"].span <= 10 * SPAN
    assert window.forced >= 30  # the old epoch's lagged keys, counted
    assert key("a", jumped + 100) in window
    bits = SeqBits()
    bits.add(jumped, limit=64)
    assert bits.add(5, limit=64) == 1 and 5 not in bits and bits.span <= 64


def test_the_lagged_keys_are_journaled_as_snapshots_and_rebuilt_after_a_restart(
    tmp_path: Path,
) -> None:
    """A restart (as a pair's promotion) while a link lags far past the window: every key
    it may still bring is known again, and the journal holds a snapshot and the records
    of the newest keys, not every key."""
    harness = Harness(tmp_path)
    try:
        keys = DurableKeys(size=10)
        keys.register("direct")
        keys.register("via-b")
        keys.load(harness.vhost)
        for start in range(0, 3_000, 30):
            batch = [key("a", seq) for seq in range(start, start + 30, 3)]
            for each in batch:
                keys.claim(each)
            harness.committer.add(keys.record(harness.vhost, batch))
            harness.commit()
            keys.settle(batch, [])
            keys.passed("direct", batch)
        records = len(harness.vhost.queues[QUEUE_NAME].entries)
        assert records < 15  # a snapshot and the newest keys' records, not 100
    finally:
        harness.close()
    again = Harness(tmp_path)
    try:
        keys = DurableKeys(size=10)
        keys.register("direct")
        keys.register("via-b")
        keys.load(again.vhost)
        assert all(key("a", seq) in keys for seq in range(0, 3_000, 3))
        assert not any(key("a", seq) in keys for seq in range(1, 3_000, 3))
        assert keys.window.forced == 0
    finally:
        again.close()


def test_a_record_whose_keys_are_in_flight_is_kept_past_a_snapshot(tmp_path: Path) -> None:
    """A batch recorded but not yet durable when a snapshot is taken: its record stays,
    else a crash after its commit would forget its keys."""
    harness = Harness(tmp_path)
    try:
        keys = DurableKeys(size=2)
        keys.register("direct")
        keys.register("via-b")
        keys.load(harness.vhost)
        pending = [key("a", 1_000)]
        keys.claim(pending[0])
        harness.committer.add(keys.record(harness.vhost, pending))
        for start in range(0, 100, 5):
            batch = [key("a", seq) for seq in range(start, start + 5)]
            for each in batch:
                keys.claim(each)
            harness.committer.add(keys.record(harness.vhost, batch))
            keys.settle(batch, [])
        harness.commit()
        keys.settle(pending, [])
    finally:
        harness.close()
    again = Harness(tmp_path)
    try:
        keys = DurableKeys(size=2)
        keys.register("direct")  # the links exist before the window loads (service.py)
        keys.register("via-b")
        keys.load(again.vhost)
        assert key("a", 1_000) in keys
        assert all(key("a", seq) in keys for seq in range(100))
    finally:
        again.close()
