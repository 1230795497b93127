"""The mirror's pure parts without sockets: the event codec, the holding set, and the applier
on a real virtual host over a real journal (`sansio.Harness`), fed events by hand; the heap
freezer of both ends with the real garbage collector."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from twinmq.broker.codec import decode_content_header, decode_headers
from twinmq.broker.definitions import BindingDef, Definitions, ExchangeDef, QueueDef
from twinmq.broker.fieldtable import as_text
from twinmq.broker.heap import HeapFreezer
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.journal.ops import encode_ops
from twinmq.broker.mirror.applier import DLQ_NAME, ORPHANS_NAME, HoldingSet, MirrorApplier
from twinmq.broker.mirror.bidi import BidiMeta, IdMap, TopologyDelta, encode_bidi
from twinmq.broker.mirror.events import (
    TOP_MID,
    SnapshotRange,
    decode_event,
    encode_definitions_event,
    encode_ops_event,
    encode_seed_event,
    encode_snapshot_event,
    is_seed,
    mirrored_definitions,
    record_header,
)
from twinmq.broker.mirror.source import MirrorSource, op_bytes_by_queue
from twinmq.broker.settings import parse_args
from twinmq.testing.sansio import Harness

QID = 3
TOPOLOGY = Definitions(queues=[QueueDef(name="q", qid=QID)], next_qid=QID + 1)


def message(mid: int) -> StoredMessage:
    body = f"m{mid}".encode()
    return StoredMessage(mid, QID, "", "q", record_header(len(body)), body, 1.9e9)


def test_events_decode_to_what_was_encoded_and_garbage_is_refused() -> None:
    ops = [message(1), Settle(QID, 1)]
    event = decode_event(5, encode_ops_event(ops, 123.5))
    assert (event.seq, event.created, event.ops, event.definitions) == (5, 123.5, ops, None)
    assert decode_event(6, encode_definitions_event(TOPOLOGY, 1.0)).definitions == TOPOLOGY
    for garbage in (b"", b"\x09" + bytes(8), encode_ops_event(ops, 0.0)[:-3]):
        with pytest.raises(ValueError):
            decode_event(7, garbage)


def test_seed_and_snapshot_events_decode_with_their_reason_and_range() -> None:
    seed = encode_seed_event("first activation", 2.0)
    assert is_seed(seed) and not is_seed(encode_ops_event([], 2.0))
    assert decode_event(1, seed).seed == "first activation"
    covered = SnapshotRange(QID, 5, TOP_MID)
    event = decode_event(2, encode_snapshot_event(covered, [message(6)], 3.0))
    assert (event.snapshot, event.ops) == (covered, [message(6)])
    with pytest.raises(ValueError, match="range truncated"):
        decode_event(3, encode_snapshot_event(covered, [], 3.0)[:20])


def test_internal_queues_and_their_bindings_are_never_mirrored() -> None:
    defs = Definitions(
        exchanges=[ExchangeDef(name="x", type="fanout")],
        queues=[QueueDef(name="amq.twinmq.mirror", qid=1 << 62), QueueDef(name="q", qid=1)],
        bindings=[
            BindingDef(exchange="x", queue="amq.twinmq.mirror", routing_key=""),
            BindingDef(exchange="x", queue="q", routing_key=""),
        ],
    )
    mirrored = mirrored_definitions(defs)
    assert [q.name for q in mirrored.queues] == ["q"]
    assert [b.queue for b in mirrored.bindings] == ["q"]


def test_the_holding_set_is_bounded_and_forgets_after_its_ttl() -> None:
    held = HoldingSet(limit=2, ttl=10.0)
    for mid in (1, 2, 3):
        held.add((QID, mid), now=0.0)
    assert len(held) == 2 and not held.take((QID, 1), now=1.0)  # the oldest went
    assert held.take((QID, 2), now=1.0) and not held.take((QID, 2), now=1.0)  # used once
    assert not held.take((QID, 3), now=10.0)  # expired


@pytest.fixture
def mirror(tmp_path: Path) -> Harness:
    return Harness(tmp_path / "mirror")


def applier(h: Harness) -> MirrorApplier:
    return MirrorApplier(h.vhost, h.committer, h.clock.time, retries=2)


def ready(h: Harness, name: str = "q") -> list[bytes]:
    return [e.message.body for e in h.vhost.queues[name].entries]


def test_events_applied_twice_change_nothing_the_second_time(mirror: Harness) -> None:
    apply = applier(mirror)
    events = [
        (10, encode_definitions_event(TOPOLOGY, 0.0)),
        (11, encode_ops_event([message(1), message(2)], 0.0)),
    ]
    assert apply.apply("a", events).seq == 11
    mirror.commit()
    again = apply.apply("a", [*events, (12, encode_ops_event([Settle(QID, 1)], 0.0))])
    assert (again.applied, again.seq) == (1, 12)
    mirror.commit()
    assert ready(mirror) == [b"m2"]
    assert apply.applied("a") == 12 and apply.applied("other-origin") == 0
    mirror.close()


def test_the_applied_mark_is_durable_with_the_effects_it_covers(tmp_path: Path) -> None:
    first = Harness(tmp_path / "m")
    applier(first).apply(
        "a",
        [(1, encode_definitions_event(TOPOLOGY, 0.0)), (2, encode_ops_event([message(7)], 0.0))],
    )
    first.commit()
    first.close()
    reopened = Harness(tmp_path / "m")
    assert applier(reopened).applied("a") == 2
    assert ready(reopened) == [b"m7"]
    reopened.close()


def test_a_settle_that_comes_before_its_message_is_held_and_applied_on_arrival(
    mirror: Harness,
) -> None:
    apply = applier(mirror)
    apply.apply("a", [(1, encode_definitions_event(TOPOLOGY, 0.0))])
    apply.apply("a", [(2, encode_ops_event([Settle(QID, 5)], 0.0))])
    assert len(apply.holding) == 1 and ready(mirror) == []
    apply.apply("a", [(3, encode_ops_event([message(5), message(6)], 0.0))])
    mirror.commit()
    assert ready(mirror) == [b"m6"] and len(apply.holding) == 0
    mirror.close()


def test_an_event_that_keeps_failing_goes_to_the_dlq_and_the_stream_goes_on(
    mirror: Harness,
) -> None:
    apply = applier(mirror)
    apply.apply("a", [(1, encode_definitions_event(TOPOLOGY, 0.0))])
    broken = (2, b"\x01not an event")
    first = apply.apply("a", [broken, (3, encode_ops_event([message(9)], 0.0))])
    assert first.retry is not None and first.applied == 0 and apply.applied("a") == 1
    second = apply.apply("a", [broken, (3, encode_ops_event([message(9)], 0.0))])
    assert second.retry is None and second.seq == 3
    mirror.commit()
    assert ready(mirror) == [b"m9"]
    assert ready(mirror, DLQ_NAME) == [b"\x01not an event"]
    header = mirror.vhost.queues[DLQ_NAME].entries[0].message.header
    decode_content_header(header)  # a valid header: consumers of the DLQ can read it
    headers = decode_headers(header)
    assert as_text(headers.get("x-mirror-origin")) == "a"
    assert "malformed ops" in (as_text(headers.get("x-mirror-reason")) or "")
    mirror.close()


@pytest.mark.parametrize(
    "args",
    [
        ["--mirror-to", "127.0.0.1:5999"],
        ["--mirror-port", "5999"],
        ["--mirror-to", "127.0.0.1:5999", "--mirror-port", "5998", "--mirror-token", "t"],
        ["--mirror-port", "5998", "--mirror-role", "source", "--mirror-token", "t"],
    ],
)
def test_a_mirror_link_needs_its_token_and_a_broker_with_both_ends_names_its_role(
    args: list[str],
) -> None:
    with pytest.raises(ValidationError):
        parse_args(args)


@pytest.mark.parametrize(
    ("args", "role"),
    [
        (["--mirror-to", "127.0.0.1:5999"], "source"),
        (["--mirror-port", "5999"], "replica"),
        (["--mirror-to", "127.0.0.1:5999", "--mirror-port", "5998", "--mirror-role", "replica"],
         "replica"),
        ([], None),
    ],
)  # fmt: skip
def test_a_sites_first_dr_role_follows_its_ends_or_its_flag(
    args: list[str], role: str | None
) -> None:
    settings = parse_args([*args, "--mirror-token", "t"] if args else [])
    assert settings.mirror_first_role == role


def test_a_snapshot_moves_what_the_mirror_holds_in_its_range_and_the_source_lacks_to_orphans(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path / "m")
    apply = applier(h)
    apply.apply("a", [(1, encode_definitions_event(TOPOLOGY, 0.0))])
    apply.apply("a", [(2, encode_ops_event([message(m) for m in range(1, 11)], 0.0))])
    # The source holds 1, 3 and 5 of 0..5, then (open above) 7 and 12.
    low = encode_snapshot_event(SnapshotRange(QID, 0, 5), [message(1), message(3), message(5)], 0)
    high = encode_snapshot_event(SnapshotRange(QID, 6, TOP_MID), [message(7), message(12)], 0)
    apply.apply("a", [(3, encode_seed_event("test", 0.0)), (4, low)])
    assert ready(h) == [b"m1", b"m3", b"m5", b"m6", b"m7", b"m8", b"m9", b"m10"]
    apply.apply("a", [(5, high)])
    h.commit()
    assert ready(h) == [b"m1", b"m3", b"m5", b"m7", b"m12"]
    orphans = h.vhost.queues[ORPHANS_NAME].entries
    assert [e.message.body for e in orphans] == [b"m2", b"m4", b"m6", b"m8", b"m9", b"m10"]
    headers = decode_headers(orphans[0].message.header)
    assert as_text(headers.get("x-mirror-orphan-queue")) == "q"
    h.close()
    reopened = Harness(tmp_path / "m")  # durable with the mark that covers it
    assert ready(reopened) == [b"m1", b"m3", b"m5", b"m7", b"m12"]
    assert len(reopened.vhost.queues[ORPHANS_NAME].entries) == 6
    reopened.close()


def test_the_bidirectional_id_map_is_durable_with_the_messages_it_maps(tmp_path: Path) -> None:
    def event(oseq: int, ops: list[JournalOp], topology: TopologyDelta | None = None) -> bytes:
        meta = BidiMeta(
            origin="site-a", oseq=oseq, hops=["site-a"], keys=[("q", "site-a")], topology=topology
        )
        return encode_bidi(meta, ops, 0.0)

    def bidi(h: Harness) -> tuple[IdMap, MirrorApplier]:
        ids = IdMap(h.vhost, "site-b")
        return ids, MirrorApplier(h.vhost, h.committer, h.clock.time, ids=ids)

    def sent(mid: int) -> StoredMessage:  # qid 0: the event's first key, ("q", "site-a")
        body = f"m{mid}".encode()
        return StoredMessage(mid, 0, "", "q", record_header(len(body)), body, None)

    first = Harness(tmp_path / "m")
    ids, apply = bidi(first)
    declare = TopologyDelta(declare_queues=[QueueDef(name="q", qid=77)])
    events = [(1, event(1, [], declare)), (2, event(2, [sent(500), sent(501)]))]
    assert apply.apply("site-a", events).applied == 2
    first.commit()
    local = ids.local("site-a", 500)
    assert local is not None and ids.origin_of(local) == ("site-a", 500) and len(ids) == 2
    first.close()
    reopened = Harness(tmp_path / "m")  # the map and the mark as on disk
    ids, apply = bidi(reopened)
    assert ids.local("site-a", 500) == local
    assert apply.apply("site-a", events).applied == 0  # re-sent: applied before
    apply.apply("site-a", [(3, event(3, [Settle(0, 500)]))])  # A's id, settled here
    reopened.commit()
    assert ready(reopened) == [b"m501"] and ids.local("site-a", 500) is None and len(ids) == 1
    reopened.close()


# -- the heap freezer (`broker/heap.py`), with the real garbage collector ----------------------


class Node:
    """A tracked object that can be put in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


class Clock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def thawed() -> Iterator[None]:
    """Each test starts and ends with nothing frozen in this test process."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def cycle() -> weakref.ref[Node]:
    """A two-node reference cycle, unreachable once this returns; a weak reference to it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_freeze_moves_what_is_held_out_of_the_collectors_generations(thawed: None) -> None:
    held = [Node() for _ in range(1000)]
    HeapFreezer(clock=Clock()).freeze()
    assert gc.get_freeze_count() >= len(held)
    assert all(not any(o is n for o in gc.get_objects()) for n in held[:3])  # none walked


def test_a_garbage_cycle_frozen_is_reclaimed_at_the_next_sweep_not_before(thawed: None) -> None:
    clock = Clock()
    freezer = HeapFreezer(clock=clock, sweep_every=300.0)
    doomed = _frozen_cycle(freezer)
    gc.collect()
    assert doomed() is not None  # frozen: full collections do not walk it
    clock.now += 299.0
    freezer.freeze()
    gc.collect()
    assert doomed() is not None and freezer.sweeps == 0
    clock.now += 1.0
    freezer.freeze()  # the sweep: unfrozen, collected, then the rest frozen again
    assert doomed() is None and freezer.sweeps == 1
    assert gc.get_freeze_count() > 0


def _frozen_cycle(freezer: HeapFreezer) -> weakref.ref[Node]:
    """A cycle still referenced at a freeze, dropped right after it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    freezer.freeze()
    ref = weakref.ref(a)
    del a, b
    return ref


def test_an_unfrozen_garbage_cycle_is_still_collected_as_usual(thawed: None) -> None:
    doomed = cycle()
    gc.collect()
    assert doomed() is None


def test_the_applier_freezes_the_heap_after_each_batch_it_applies(
    tmp_path: Path, thawed: None
) -> None:
    mirror = Harness(tmp_path / "mirror")
    applier = MirrorApplier(mirror.vhost, mirror.committer, mirror.clock.time)
    applier.heap = HeapFreezer(clock=Clock())
    applier.apply("a", [(1, encode_definitions_event(TOPOLOGY, 0.0))])
    gc.unfreeze()
    applier.apply("a", [(2, encode_ops_event([message(1), message(2)], 0.0))])
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    assert applier.apply("a", [(2, encode_ops_event([message(1)], 0.0))]).applied == 0
    assert gc.get_freeze_count() == 0  # nothing applied (a re-sent event): nothing new held
    mirror.commit()
    assert ready(mirror) == [b"m1", b"m2"]
    mirror.close()


def test_the_source_freezes_the_heap_after_each_event_it_makes(
    tmp_path: Path, thawed: None
) -> None:
    source_site = Harness(tmp_path / "source")
    source = MirrorSource(source_site.vhost, source_site.committer, source_site.clock.time)
    source.heap = HeapFreezer(clock=Clock())
    source_site.committer.tap = source
    source.activate()  # the first activation's seed and topology: events made
    assert gc.get_freeze_count() > 0 and source.depth >= 2
    source_site.commit()
    gc.unfreeze()
    source_site.committer.add([message(1)])
    source_site.commit()
    assert gc.get_freeze_count() > 0  # the batch's event
    assert source.depth >= 3
    source_site.close()


def test_a_batchs_event_carries_its_journal_encoding_and_its_queues_lag_bytes(
    tmp_path: Path,
) -> None:
    """The event of a batch is its ops' journal encoding (taken from the journal's own
    record); the bytes it lags by per queue are that encoding's length for a one-queue
    batch, and each queue's ops' bytes otherwise."""
    site = Harness(tmp_path / "source")
    source = MirrorSource(site.vhost, site.committer, site.clock.time)
    site.committer.tap = source
    source.activate()
    site.commit()
    one: list[JournalOp] = [message(1), message(2), Settle(QID, 1)]
    site.committer.add(one)
    site.commit()
    encoded = bytearray()
    encode_ops(one, encoded)
    body = source.queue.entries[-1].message.body
    assert body.endswith(encoded) and decode_event(0, body).ops == one
    assert source.queue_lag_bytes == {QID: len(encoded)} == op_bytes_by_queue(one)
    other = StoredMessage(4, QID + 1, "", "r", record_header(1), b"r", None)
    site.committer.add([message(3), other])
    site.commit()
    assert decode_event(0, source.queue.entries[-1].message.body).ops == [message(3), other]
    assert source.queue_lag_bytes == {
        QID: len(encoded) + op_bytes_by_queue([message(3)])[QID],
        QID + 1: op_bytes_by_queue([other])[QID + 1],
    }
    source.acked(source.head)
    assert source.queue_lag_bytes == {} and source.depth == 0
    site.close()
