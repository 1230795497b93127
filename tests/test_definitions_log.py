"""The durable topology as a snapshot plus a log of changes (broker/journal/deflog.py).

Each declare, bind, unbind and delete is one append to `definitions.log` (and one
fsync) instead of a rewrite of the whole `definitions.json`. These tests prove it
keeps what the old file kept: every acknowledged change survives kill -9, a torn
tail (a crash mid-append) loses only the change never acknowledged, damage before
the tail is refused loudly and kept, a crash at any step of a compaction recovers
the same topology, and a pair's passive gets the changes (as deltas, or whole for
a passive of an older version).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pika
import pytest
from replpeer import hello_for

from twinmq.broker import damage
from twinmq.broker.definitions import (
    BindingDef,
    Definitions,
    DefinitionsDelta,
    ExchangeDef,
    QueueDef,
    TopologyState,
)
from twinmq.broker.journal import Journal, JournalError
from twinmq.broker.journal.deflog import LOG, load
from twinmq.broker.journal.segment import REC
from twinmq.broker.replication.protocol import (
    Challenge,
    FrameDecoder,
    FrameType,
    Snapshot,
    encode,
)
from twinmq.broker.routing import make_exchange
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair
from twinmq.testing.waiting import wait_for

EXCHANGE, QUEUE = "topo.x", "topo.q"


def _bind_keys(url: str, keys: list[str], *, unbind: Sequence[str] = ()) -> None:
    """Declare the durable exchange and queue, bind `keys` one by one, unbind `unbind`."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = connection.channel()
        ch.exchange_declare(EXCHANGE, "direct", durable=True)
        ch.queue_declare(QUEUE, durable=True)
        for key in keys:
            ch.queue_bind(QUEUE, EXCHANGE, key)
        for key in unbind:
            ch.queue_unbind(QUEUE, EXCHANGE, key)
    finally:
        connection.close()


def _routed_keys(url: str, keys: list[str]) -> list[str]:
    """The keys among `keys` for which a publish to the exchange reaches the queue."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = connection.channel()
        ch.confirm_delivery()
        ch.queue_purge(QUEUE)
        for key in keys:
            ch.basic_publish(EXCHANGE, key, key.encode())
        got = []
        while True:
            method, _, body = ch.basic_get(QUEUE, auto_ack=True)
            if method is None:
                break
            got.append(body.decode())
        return sorted(got)
    finally:
        connection.close()


def _stored(data: Path) -> Definitions:
    """The topology on disk (snapshot and log), read as recovery reads it."""
    return load(data / "journal").state.definitions()


def _record_offsets(log: bytes) -> list[tuple[int, int]]:
    """(start, end) of each record of a definitions log, behind its header."""
    pos, out = 20, []
    while pos + REC.size <= len(log):
        length, _ = REC.unpack_from(log, pos)
        end = pos + REC.size + length
        if end > len(log):
            break
        out.append((pos, end))
        pos = end
    return out


# -- durability of each change --------------------------------------------------------------


def test_every_acknowledged_topology_change_survives_kill_9(tmp_path: Path) -> None:
    data = tmp_path / "a"
    keys = [f"k{i}" for i in range(40)]
    broker = BrokerProcess(data, name="deflog").start()
    try:
        _bind_keys(broker.url, keys, unbind=["k3", "k7"])
        broker.kill()  # no clean close: the changes are in the log only
        assert (data / "journal" / LOG).stat().st_size > 20
        broker = BrokerProcess(data, name="deflog", port=broker.port).start()
        expected = sorted(k for k in keys if k not in ("k3", "k7"))
        assert _routed_keys(broker.url, keys) == expected
    finally:
        broker.stop()
    # A clean stop folds the log into the snapshot: definitions.json is the whole topology.
    snapshot = (data / "journal" / "definitions.json").read_text()
    assert '"routing_key": "k39"' in snapshot and '"routing_key": "k3"' not in snapshot
    assert (data / "journal" / LOG).stat().st_size == 20  # a header, no record


def test_a_torn_tail_loses_only_the_change_that_was_never_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "a"
    broker = BrokerProcess(data, name="torn").start()
    try:
        _bind_keys(broker.url, ["a", "b", "c"])
        broker.kill()
        path = data / "journal" / LOG
        log = path.read_bytes()
        start, end = _record_offsets(log)[-1]  # the binding "c"
        path.write_bytes(log[: start + (end - start) // 2])  # a crash mid-append
        broker = BrokerProcess(data, name="torn", port=broker.port).start()
        assert _routed_keys(broker.url, ["a", "b", "c"]) == ["a", "b"]
        assert "definitions log: truncating torn tail" in (tmp_path / "torn.log").read_text()
        assert path.stat().st_size == start  # truncated: the next change follows "b"
    finally:
        broker.stop()


def test_a_flipped_bit_before_the_tail_refuses_the_start_and_keeps_the_file(
    tmp_path: Path,
) -> None:
    """A damaged record with intact ones after it is not a torn tail: skipping it could
    lose a queue's declaration (and recovery would drop that queue's messages), so the
    broker refuses to start, names the file, and changes nothing."""
    data = tmp_path / "a"
    broker = BrokerProcess(data, name="flip").start()
    _bind_keys(broker.url, ["a", "b", "c", "d"])
    broker.kill()
    path = data / "journal" / LOG
    log = path.read_bytes()
    _, end = _record_offsets(log)[3]  # the binding "b"
    flipped = bytearray(log)
    flipped[end - 3] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(RuntimeError, match=r"definitions\.log is damaged: checksum mismatch"):
        BrokerProcess(data, name="flip").start()
    assert path.read_bytes() == bytes(flipped)  # kept as it was
    # Listed in DAMAGED.json like a damaged segment, once however often the start is tried.
    with pytest.raises(RuntimeError, match=r"definitions\.log is damaged"):
        BrokerProcess(data, name="flip").start()
    marker = damage.load(data)
    assert marker is not None
    assert [(c.segment, c.offset) for c in marker.corruption] == [(LOG, _record_offsets(log)[3][0])]
    assert "checksum" in marker.corruption[0].reason
    path.write_bytes(log)  # the operator restores it
    broker = BrokerProcess(data, name="flip").start()
    try:
        assert _routed_keys(broker.url, ["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    finally:
        broker.stop()


def test_an_older_data_directory_with_only_the_snapshot_loads_unchanged(tmp_path: Path) -> None:
    journal = tmp_path / "a" / "journal"
    journal.mkdir(parents=True)
    old = Definitions(
        exchanges=[ExchangeDef(name=EXCHANGE, type="direct")],
        queues=[QueueDef(name=QUEUE, qid=1)],
        bindings=[BindingDef(exchange=EXCHANGE, queue=QUEUE, routing_key="old")],
        next_qid=2,
    )
    (journal / "definitions.json").write_text(old.model_dump_json())  # no checksum, no log
    broker = BrokerProcess(tmp_path / "a", name="old").start()
    try:
        _bind_keys(broker.url, ["new"])
        assert _routed_keys(broker.url, ["old", "new"]) == ["new", "old"]
        broker.kill()
        broker = BrokerProcess(tmp_path / "a", name="old", port=broker.port).start()
        assert _routed_keys(broker.url, ["old", "new"]) == ["new", "old"]
    finally:
        broker.stop()


# -- compaction ---------------------------------------------------------------------------


class _Crash(BaseException):
    """A crash injected at a step of the store (not an error the code may handle)."""


def _changes(n: int) -> list[DefinitionsDelta]:
    first = [
        DefinitionsDelta(add_exchanges=[ExchangeDef(name="x", type="topic")]),
        DefinitionsDelta(add_queues=[QueueDef(name="q", qid=1)], next_qid=2),
    ]
    binds = [
        DefinitionsDelta(add_bindings=[BindingDef(exchange="x", queue="q", routing_key=f"k.{i}")])
        for i in range(n)
    ]
    return first + binds + [DefinitionsDelta(del_bindings=[binds[0].add_bindings[0]])]


def _as_set(defs: Definitions) -> tuple[object, ...]:
    return (
        sorted(e.name for e in defs.exchanges),
        sorted((q.name, q.qid) for q in defs.queues),
        sorted(b.routing_key for b in defs.bindings),
        defs.next_qid,
    )


@pytest.mark.parametrize("step", ["snapshot-write", "snapshot-rename", "log-reset"])
def test_a_crash_at_any_step_of_a_compaction_recovers_the_same_topology(
    tmp_path: Path, step: str
) -> None:
    """The change that triggers the compaction is durable before it starts; a crash
    before the new snapshot's rename leaves the old snapshot and its whole log, after it
    the new snapshot and a log of the old generation, which recovery ignores."""
    changes = _changes(30)
    journal = Journal(tmp_path)
    journal.open()
    store = journal._defs
    store._compact_min = 1500
    expected = TopologyState()
    crashed_at = None
    fired = False

    def fault(name: str) -> None:
        nonlocal fired
        if name == step and store.log_records > 3 and not fired:
            fired = True
            raise _Crash(name)

    store.fault = fault
    for i, delta in enumerate(changes):
        try:
            journal.save_delta(delta)
        except _Crash:
            crashed_at = i
            break
        expected.apply(delta)
    assert crashed_at is not None, "no compaction ran"
    # Compaction starts once the change that triggers it is appended and fsynced.
    expected.apply(changes[crashed_at])
    journal._simulate_crash()
    reopened = Journal(tmp_path)
    recovered = reopened.open()
    assert _as_set(recovered.definitions) == _as_set(expected.definitions())
    # ... and the store goes on from there: the rest of the changes, another crash.
    for delta in changes[crashed_at + 1 :]:
        reopened.save_delta(delta)
        expected.apply(delta)
    reopened._simulate_crash()
    again = Journal(tmp_path)
    assert _as_set(again.open().definitions) == _as_set(expected.definitions())
    again._simulate_crash()


def test_a_crash_while_appending_records_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open()
    changes = _changes(3)
    for delta in changes[:-1]:
        journal.save_delta(delta)

    def fault(name: str) -> None:
        if name == "append":
            raise _Crash(name)

    journal._defs.fault = fault
    with pytest.raises(_Crash):
        journal.save_delta(changes[-1])
    journal._simulate_crash()
    state = TopologyState()
    for delta in changes[:-1]:
        state.apply(delta)
    reopened = Journal(tmp_path)
    assert _as_set(reopened.open().definitions) == _as_set(state.definitions())
    reopened._simulate_crash()


def test_a_whole_replacement_is_not_mixed_with_the_old_log(tmp_path: Path) -> None:
    """A passive's catch-up replaces the topology whole: the changes logged before it
    must not come back on top of it (the log is of an older generation)."""
    journal = Journal(tmp_path)
    journal.open()
    journal.save_delta(DefinitionsDelta(add_queues=[QueueDef(name="gone", qid=1)], next_qid=2))
    journal.save_definitions(Definitions(queues=[QueueDef(name="kept", qid=2)], next_qid=3))
    journal._simulate_crash()
    reopened = Journal(tmp_path)
    assert [q.name for q in reopened.open().definitions.queues] == ["kept"]
    reopened._simulate_crash()


def test_a_snapshot_lost_under_its_log_refuses_the_start(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open()
    journal.save_delta(DefinitionsDelta(add_queues=[QueueDef(name="q", qid=1)], next_qid=2))
    journal._simulate_crash()
    (tmp_path / "definitions.json").unlink()
    with pytest.raises(JournalError, match="refusing to start"):
        Journal(tmp_path).open()


# -- replication ------------------------------------------------------------------------------


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    """A started pair (`a` active, `b` passive)."""
    with Pair(tmp_path, replication_timeout=2.0) as started:
        yield started


@pytest.mark.slow
def test_bindings_made_on_the_active_are_all_on_the_promoted_passive(pair: Pair) -> None:
    keys = [f"key.{i}" for i in range(2000)]
    _bind_keys(pair.active.url, keys)
    active_dir = pair.active.data_dir
    wait_for(
        "the passive holds every binding",
        lambda: len(_stored(pair.passive.data_dir).bindings) == len(keys),
        30,
    )
    assert len(_stored(active_dir).bindings) == len(keys)
    pair.active.kill()
    pair.promote_passive()
    assert _routed_keys(pair.active.url, keys) == sorted(keys)


def _fake_passive_frames(
    broker: BrokerProcess, snapshot: Snapshot, change: str
) -> list[tuple[FrameType, bytes]]:
    """Attach as passive "b" with `snapshot`, declare queue `change` on the broker, and
    return the topology frames the active sent after the attach's whole DEFINITIONS."""

    async def scenario() -> list[tuple[FrameType, bytes]]:
        reader, writer = await asyncio.open_connection(broker.host, broker.replication_port)
        decoder = FrameDecoder()
        frames: list[tuple[FrameType, bytes]] = []

        async def next_frame() -> tuple[FrameType, bytes]:
            while not frames:
                data = await asyncio.wait_for(reader.read(65536), 5)
                assert data, "the active closed the replication link"
                frames.extend(decoder.feed(data))
            return frames.pop(0)

        async def expect(wanted: FrameType) -> bytes:
            while True:
                ftype, payload = await next_frame()
                if ftype is wanted:
                    return payload

        challenge = Challenge.model_validate_json(await expect(FrameType.CHALLENGE))
        writer.write(encode(FrameType.HELLO, hello_for(Pair.TOKEN, challenge, "b", 1)))
        await expect(FrameType.WELCOME)
        writer.write(encode(FrameType.SNAPSHOT, snapshot))
        await expect(FrameType.DEFINITIONS)  # the whole topology, at every attach
        await asyncio.to_thread(_declare, broker, change)
        seen: list[tuple[FrameType, bytes]] = []
        while not any(change.encode() in p for _, p in seen):
            ftype, payload = await next_frame()
            if ftype in (FrameType.DEFINITIONS, FrameType.DEFINITIONS_DELTA):
                seen.append((ftype, payload))
        writer.close()
        return seen

    return asyncio.run(scenario())


def _declare(broker: BrokerProcess, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        connection.channel().queue_declare(queue, durable=True)
    finally:
        connection.close()


@pytest.mark.parametrize("takes_deltas", [False, True])
def test_a_passive_gets_deltas_only_if_its_snapshot_says_it_takes_them(
    pair: Pair, takes_deltas: bool
) -> None:
    """A passive of the version before DEFINITIONS_DELTA (its SNAPSHOT has no
    `definitions_delta`) must get every change as a whole DEFINITIONS frame."""
    _declare(pair.active, "before.q")
    pair.passive.stop()
    seen = _fake_passive_frames(
        pair.active, Snapshot(definitions_delta=takes_deltas), f"change-{takes_deltas}.q"
    )
    wanted = FrameType.DEFINITIONS_DELTA if takes_deltas else FrameType.DEFINITIONS
    assert [ftype for ftype, _ in seen] == [wanted]
    if takes_deltas:
        delta = DefinitionsDelta.model_validate_json(seen[0][1])
        assert [q.name for q in delta.add_queues] == ["change-True.q"]
    else:
        whole = Definitions.model_validate_json(seen[0][1])
        assert {"before.q", "change-False.q"} <= {q.name for q in whole.queues}


def test_a_real_passive_applies_deletes_and_rebinds_from_deltas(pair: Pair) -> None:
    _bind_keys(pair.active.url, ["a", "b"], unbind=["a"])
    connection = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    try:
        ch = connection.channel()
        ch.queue_declare("doomed.q", durable=True)
        ch.queue_bind("doomed.q", EXCHANGE, "z")
        ch.queue_delete("doomed.q")
        ch.exchange_declare("gone.x", "fanout", durable=True)
        ch.exchange_delete("gone.x")
    finally:
        connection.close()
    expected = _as_set(_stored(pair.active.data_dir))
    wait_for(
        "the passive's stored topology equals the active's",
        lambda: _as_set(_stored(pair.passive.data_dir)) == expected,
        10,
    )
    pair.active.kill()
    pair.promote_passive()
    assert _routed_keys(pair.active.url, ["a", "b", "z"]) == ["b"]


def test_a_direct_exchange_routes_as_its_bindings_say_after_any_changes() -> None:
    """The direct exchange's table is kept up to date one binding at a time (a rebuild
    per bind made n bindings cost n^2); bindings that differ only in their arguments
    route once and stop routing only when the last of them goes."""
    exchange = make_exchange(ExchangeDef(name="x", type="direct"))
    rng = random.Random(15)
    for _ in range(3000):
        queue, key = f"q{rng.randint(0, 4)}", f"k{rng.randint(0, 4)}"
        arguments = {"a": rng.randint(0, 2)} if rng.random() < 0.5 else {}
        binding = BindingDef(exchange="x", queue=queue, routing_key=key, arguments=arguments)
        roll = rng.random()
        if roll < 0.6:
            exchange.bind(binding)
        elif roll < 0.9:
            exchange.unbind(binding)
        else:
            exchange.unbind_queue(queue)
        for probe in (f"k{i}" for i in range(5)):
            wanted = {b.queue for b in exchange.bindings.values() if b.routing_key == probe}
            routed = list(exchange.route(probe, None))
            assert sorted(routed) == sorted(wanted)  # each queue once
