"""A forced failover's reversal sends the delta, not the whole seed (docs/mirror.md,
"Re-seed and orphans": "The seed as a delta").

Between real sites, through pika: site A mirrors to B, a partition hides A's last
changes from B, A dies, B is promoted by force and A, back, is fenced and reversed.
B's seed is compared with what A holds (RECONCILE) and only the difference crosses
the link: the bytes B sends (its `/metrics`) follow the k messages that differ, not
the N both sites hold; A ends exactly as a full seed would leave it (same messages,
the same orphans), also when either site is killed in the middle of the delta. A,
back, counts what it journaled that B never applied (the RPO, as a count).
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mirrorsites import Sites, channel, demote, metric, mirror_status, promote, publish, queues
from test_mirror_reseed import ORPHANS, bodies, orphans

from twinmq.broker.journal import StoredMessage
from twinmq.broker.mirror.delta import Chunk, Reconciler, answer, wire
from twinmq.broker.mirror.events import (
    TOP_MID,
    SnapshotRange,
    decode_event,
    encode_snapshot_event,
)
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


class Held:
    """What the mirror's answer reads of its virtual host: queues by id, their messages."""

    def __init__(self, held: dict[int, set[int]]) -> None:
        self.held = held

    def queue_by_qid(self, qid: int) -> Any:
        if qid not in self.held:
            return None
        entries = [SimpleNamespace(message=SimpleNamespace(mid=mid)) for mid in self.held[qid]]
        return SimpleNamespace(entries=entries, delivered={}, held_aside={})


def snapshot_chunks(qid: int, mids: list[int], per_event: int) -> list[Chunk]:
    """A seed's snapshot events of one queue, as the source cuts them (the last one open)."""
    chunks: list[Chunk] = []
    lo = 0
    for i in range(0, len(mids), per_event):
        part = mids[i : i + per_event]
        last = i + per_event >= len(mids)
        covered = SnapshotRange(qid, lo, TOP_MID if last else part[-1])
        ops = [StoredMessage(m, qid, "", "q", b"h", b"body-%d" % m, None) for m in part]
        chunks.append(Chunk(100 + i, encode_snapshot_event(covered, ops, 0.0), covered, part))
        lo = part[-1] + 1
    return chunks


def reconcile(chunks: list[Chunk], mirror: Held) -> tuple[Reconciler, int]:
    """Run the comparison to its end against `mirror`; the bytes it exchanged."""
    reconciler = Reconciler(chunks)
    exchanged = 0
    while (request := reconciler.request()) is not None:
        reply = answer(mirror, request)  # type: ignore[arg-type]
        exchanged += len(wire(request)) + len(wire(reply))
        reconciler.answered(reply)
    return reconciler, exchanged


def applied(
    chunks: list[Chunk], reconciler: Reconciler, held: set[int]
) -> tuple[set[int], set[int]]:
    """What the mirror holds and orphans once it applied the DELTA events."""
    held = set(held)
    orphaned: set[int] = set()
    for seq, body in reconciler.bodies().items():
        event = decode_event(seq, body)
        assert event.fixes is not None and event.ops is not None
        for fix in event.fixes:
            if fix.keep is not None:
                gone = {m for m in held if fix.lo <= m <= fix.hi and m not in fix.keep}
                held -= gone
                orphaned |= gone
        held |= {op.mid for op in event.ops}
        assert all(op.body == b"body-%d" % op.mid for op in event.ops)
    return held, orphaned


@pytest.mark.parametrize("k", [0, 1, 7, 40])
def test_the_comparison_finds_exactly_the_difference_in_bytes_that_follow_k(k: int) -> None:
    rng = random.Random(k)
    source = sorted(rng.sample(range(1, 200_000), 20_000))
    mirror = set(source)
    lacking = set(rng.sample(source, k))  # settled on the mirror: the source re-sends them
    extra = {m + 1 for m in rng.sample(source, k) if m + 1 not in mirror}  # mirror's own
    extra |= {300_000 + i for i in range(k)}  # the old source's last, unmirrored ones
    mirror = (mirror - lacking) | extra
    chunks = snapshot_chunks(7, source, 4096)
    reconciler, exchanged = reconcile(chunks, Held({7: mirror}))
    assert {m for c in chunks for m in c.send} == lacking
    assert reconciler.skipped() == len(source) - k
    held, orphaned = applied(chunks, reconciler, mirror)
    assert held == set(source) and orphaned == extra  # a full seed's end state
    # ~2 KiB per difference and ~100 bytes per snapshot event, whatever is in common.
    differences = len(lacking) + len(extra)
    print(f"k={k}: {exchanged} bytes compared, {len(chunks)} events, {differences} differ")
    assert exchanged < 200 * len(chunks) + 3000 * differences
    delta = sum(len(b) for b in reconciler.bodies().values())
    assert delta < 100 * len(chunks) + 500 * differences


def test_a_mirror_without_the_queue_gets_every_message_in_one_round_and_orphans_nothing() -> None:
    source = list(range(10, 5000, 3))
    chunks = snapshot_chunks(3, source, 1000)
    reconciler, _ = reconcile(chunks, Held({}))
    assert reconciler.rounds == 1 and reconciler.skipped() == 0
    held, orphaned = applied(chunks, reconciler, set())
    assert held == set(source) and orphaned == set()


def test_an_empty_queue_on_the_source_orphans_all_the_mirror_holds_there() -> None:
    covered = SnapshotRange(3, 0, TOP_MID)
    chunks = [Chunk(5, encode_snapshot_event(covered, [], 0.0), covered, [])]
    reconciler, _ = reconcile(chunks, Held({3: {4, 9, 70}}))
    held, orphaned = applied(chunks, reconciler, {4, 9, 70})
    assert held == set() and orphaned == {4, 9, 70}


def consume_every(sites: Sites, queue: str, step: int, total: int) -> list[bytes]:
    """On the source: take all `total` messages of `queue`, ack every `step`-th, put the
    others back (the acks are settles the mirror never sees behind a partition)."""
    connection, ch = channel(sites.source)
    taken: list[bytes] = []
    try:
        for i in range(total):
            method, _, body = ch.basic_get(queue)
            assert method is not None
            if i % step == 0:
                ch.basic_ack(method.delivery_tag)
                taken.append(body)
    finally:
        connection.close()  # the others go back to the queue, unsettled
    return taken


def fence_and_reverse(sites: Sites) -> None:
    """A forced failover to B, then A back: fenced, reversed, caught up with B."""
    sites.fail_over_by_force()  # site A is gone with changes B never saw
    publish(sites.mirror, "orders", bodies("b", 5))
    sites.old_source_back()


def sent(sites: Sites) -> float:
    """Bytes B sent over its link: its events as sent, and both ways of the comparison."""
    events = metric(sites.mirror, "twinmq_mirror_sent_bytes_total") or 0.0
    return events + (metric(sites.mirror, "twinmq_mirror_reconcile_bytes_total") or 0.0)


def test_a_reversal_sends_bytes_for_the_k_messages_that_differ_not_the_n_in_common(
    tmp_path: Path,
) -> None:
    n, size = 3000, 1024
    common = [f"a-{i}-".encode().ljust(size, b".") for i in range(n)]
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", common)
        sites.caught_up()
        sites.mirror.stop()  # a partition: B will never see what follows
        consume_every(sites, "orders", 600, n)  # 5 settles B misses
        publish(sites.source, "orders", bodies("lost", 5))  # 5 messages B never gets
        fence_and_reverse(sites)
        # The end state of a full seed: B's messages (the 5 A consumed are B's still),
        # and A's 5 unmirrored ones kept aside as orphans.
        assert Counter(drain(sites.source.url, "orders")) == Counter([*common, *bodies("b", 5)])
        assert orphans(sites.source) == 5
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))
        # The bytes: the k = 15 messages that differ (5 consumed, 5 lost, 5 new), the
        # seed's topology and the comparison; nowhere near the n KiB both held.
        total = sent(sites)
        print(f"reversal with {n} x {size} B in common, 15 different: {total:.0f} bytes sent")
        assert total < 64 * 1024 < n * size // 40
        assert metric(sites.mirror, "twinmq_mirror_seed_skipped_messages_total") == n - 5
        assert "compared in" in sites.mirror.log_path.read_text()
        # A counted what it journaled and B never applied: the RPO, as a count.
        lost = mirror_status(sites.source)["unmirrored"]
        assert lost is not None and lost["promoted"] == "site-b"
        assert (lost["messages"], lost["settles"]) == (5, 5)
        assert lost["events"] >= 6  # the 5 acks, the publishes (batched), maybe a topology


def test_failing_back_after_a_forced_failover_never_replays_what_the_old_source_lost(
    tmp_path: Path,
) -> None:
    """The old source's events the promoted site never applied are counted once it is
    back, and dropped: their effects are its orphans; sent after a failback, they would
    put back on the other site the messages it never had."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 5))
        fence_and_reverse(sites)
        lost = mirror_status(sites.source)["unmirrored"]
        assert lost is not None and (lost["messages"], lost["settles"]) == (5, 0)
        back = demote(sites.mirror)
        assert back.token is not None
        assert promote(sites.source, back.token).role == "source"
        publish(sites.source, "orders", [b"after"])
        sites.caught_up()
        expected = [*bodies("a", 10), *bodies("b", 5), b"after"]
        assert drain(sites.mirror.url, "orders") == expected
        assert drain(sites.source.url, "orders") == expected
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["new source", "old source"])
def test_a_kill_9_in_the_middle_of_the_delta_ends_as_a_full_seed_would(
    tmp_path: Path, killed: str
) -> None:
    n, size = 600, 8 * 1024  # 1 MiB snapshot events: ~128 messages each, 5 of them
    common = [f"a-{i}-".encode().ljust(size, b".") for i in range(n)]
    with FaultProxy("127.0.0.1:1") as proxy:
        sites = Sites(tmp_path, reversible=True, mirror_to=proxy.address)
        proxy.retarget(f"127.0.0.1:{sites.source_port}")  # B -> proxy -> A, once reversed
        with sites:
            publish(sites.source, "orders", common)
            sites.caught_up()
            sites.mirror.stop()
            # 100 settles B misses, spread over every snapshot event: the delta re-sends
            # each of those messages (~800 KiB), slowly through the throttled link.
            consume_every(sites, "orders", 6, n)
            publish(sites.source, "orders", bodies("lost", 5))
            sites.fail_over_by_force()
            wait_for("B's seed queued", lambda: mirror_status(sites.mirror)["last_seed"], 30)
            seed = mirror_status(sites.mirror)["queue_events"]  # SEED, topology, snapshots
            publish(sites.mirror, "orders", bodies("b", 5))
            events = mirror_status(sites.mirror)["queue_events"]
            proxy.throttle(80_000)
            sites.source.start()
            wait_for("A fenced", lambda: mirror_status(sites.source)["role"] == "replica", 30)

            def midway() -> bool:
                left = (mirror_status(sites.mirror) or {}).get("queue_events", events)
                # SEED, topology and a snapshot applied; another snapshot not yet
                return events - seed < left <= events - 3

            wait_for("the delta half applied", midway, 60)
            victim = sites.mirror if killed == "new source" else sites.source
            victim.kill()
            victim.start()
            proxy.throttle(None)
            sites.caught_up(source=sites.mirror)
            assert Counter(drain(sites.source.url, "orders")) == Counter(
                [*common, *bodies("b", 5)]
            )  # every message once: none lost, none twice
            assert orphans(sites.source) == 5
            assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))
            assert queues(sites.mirror)["orders"]["messages"] == n + 5  # B unchanged
