"""Group commit of topology changes: the declares, binds and unbinds of one loop turn are
one definitions-log record (one write, one fsync), their oks held until it is durable,
in order per channel; a refused group is undone whole (broker/commit.py, deflog.py).

The connection core over a real journal (testing/sansio.py): a `feed` is one network
read, and its end is the end of the loop turn, where the staged changes are written.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from pamqp import commands

from twinmq.broker.definitions import BindingDef, DefinitionsDelta, QueueDef
from twinmq.broker.journal import Journal, deflog
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import RawClient, decode_frames, encode, publish
from twinmq.testing.sansio import Harness, Peer

EX, Q = "grp.x", "grp.q"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """A virtual host over a real journal in tmp_path."""
    h = Harness(tmp_path)
    yield h
    h.close()


def _client(harness: Harness, channels: int = 1) -> Peer:
    """A client with `channels` channels open and a durable exchange and queue."""
    peer = harness.connect()
    peer.handshake()
    for number in range(1, channels + 1):
        peer.feed(encode(number, commands.Channel.Open()))
    peer.feed(
        encode(1, commands.Exchange.Declare(exchange=EX, exchange_type="direct", durable=True))
        + encode(1, commands.Queue.Declare(queue=Q, durable=True))
    )
    return peer


def _bind(channel: int, key: str, unbind: bool = False) -> bytes:
    if unbind:
        return encode(channel, commands.Queue.Unbind(queue=Q, exchange=EX, routing_key=key))
    return encode(channel, commands.Queue.Bind(queue=Q, exchange=EX, routing_key=key))


def _types(data: bytes) -> list[tuple[int, type]]:
    return [(number, type(f)) for number, f in decode_frames(data)]


def _log_records(harness: Harness) -> int:
    return deflog.load(harness.journal._dir).log_records


def _stored_keys(harness: Harness) -> set[str]:
    return {b.routing_key for b in deflog.load(harness.journal._dir).state.bindings.values()}


def _bound_keys(harness: Harness) -> set[str]:
    return {b.routing_key for b in harness.vhost.exchanges[EX].bindings.values()}


def test_the_binds_of_one_read_are_one_record_and_answered_in_order(harness: Harness) -> None:
    peer = _client(harness)
    before = _log_records(harness)
    keys = [f"k.{i}" for i in range(200)]
    frames = peer.exchange(b"".join(_bind(1, k) for k in keys) + _bind(1, "k.0", unbind=True))
    assert [type(f) for _, f in frames] == [commands.Queue.BindOk] * 200 + [commands.Queue.UnbindOk]
    assert _log_records(harness) == before + 1
    assert _stored_keys(harness) == set(keys) - {"k.0"} == _bound_keys(harness)


def test_the_changes_of_one_turn_across_connections_are_one_record(harness: Harness) -> None:
    first, second = _client(harness), _client(harness)
    before = _log_records(harness)
    first.conn.receive_data(_bind(1, "a"))
    second.conn.receive_data(_bind(1, "b"))
    harness.committer.flush_topology()  # the end of the loop turn
    for peer in (first, second):
        assert _types(peer.conn.data_to_send()) == [(1, commands.Queue.BindOk)]
    assert _log_records(harness) == before + 1
    assert _stored_keys(harness) == {"a", "b"}


def test_no_ok_goes_before_its_change_is_on_disk(harness: Harness) -> None:
    peer = _client(harness)
    peer.end_turn = lambda: None  # the loop turn has not ended yet
    assert peer.feed(_bind(1, "held")) == b""
    assert "held" not in _stored_keys(harness)
    harness.committer.flush_topology()
    assert "held" in _stored_keys(harness)
    assert _types(peer.conn.data_to_send()) == [(1, commands.Queue.BindOk)]


def test_a_publish_after_a_bind_sees_it_and_its_confirm_follows_the_bind_ok(
    harness: Harness,
) -> None:
    peer = _client(harness)
    peer.feed(encode(1, commands.Confirm.Select()))
    peer.end_turn = lambda: None
    # A transient message: its confirm needs no journal write, so it would go at once.
    out = peer.feed(
        _bind(1, "rk")
        + publish(1, "rk", b"routed", exchange=EX)
        + encode(1, commands.Basic.Qos(prefetch_count=1))
    )
    assert out == b""  # all of it waits behind the bind
    assert harness.vhost.queues[Q].message_count == 1  # routed by the binding in memory
    harness.committer.flush_topology()
    frames = [f for _, f in decode_frames(peer.conn.data_to_send())]
    assert [type(f) for f in frames] == [
        commands.Queue.BindOk,
        commands.Basic.Ack,
        commands.Basic.QosOk,
    ]


def test_other_channels_are_not_held_by_a_channel_s_change(harness: Harness) -> None:
    peer = _client(harness, channels=2)
    peer.end_turn = lambda: None
    out = peer.feed(_bind(1, "rk") + encode(2, commands.Basic.Qos(prefetch_count=1)))
    assert _types(out) == [(2, commands.Basic.QosOk)]
    harness.committer.flush_topology()
    assert _types(peer.conn.data_to_send()) == [(1, commands.Queue.BindOk)]


def _disk_full(harness: Harness) -> None:
    def fault(step: str) -> None:
        if step == "append":
            raise OSError(errno.ENOSPC, "No space left on device")

    harness.journal._defs.fault = fault


def test_a_full_disk_refuses_the_whole_group_each_change_with_its_error_and_undoes_it(
    harness: Harness,
) -> None:
    peer = _client(harness, channels=3)
    peer.exchange(_bind(1, "kept"))
    before = _log_records(harness)
    _disk_full(harness)
    frames = peer.exchange(
        _bind(1, "new.1")
        + _bind(1, "new.2")  # the same channel: closed once, in the first one's place
        + _bind(2, "kept", unbind=True)
        + encode(
            3, commands.Exchange.Declare(exchange="grp.late", exchange_type="topic", durable=True)
        )
    )
    closes = {number: f for number, f in frames}
    assert sorted(number for number, _ in frames) == [1, 2, 3]  # one close each
    for number, method in ((1, (50, 20)), (2, (50, 50)), (3, (40, 10))):
        close = closes[number]
        assert isinstance(close, commands.Channel.Close)
        assert close.reply_code == 541
        assert "the topology could not be saved" in close.reply_text
        assert (close.class_id, close.method_id) == method
    # Undone in memory as on disk.
    assert _bound_keys(harness) == {"kept"} == _stored_keys(harness)
    assert "grp.late" not in harness.vhost.exchanges
    assert _log_records(harness) == before
    # Room again: the client's retry saves them.
    harness.journal._defs.fault = None
    peer.feed(encode(4, commands.Channel.Open()))
    assert _types(peer.feed(_bind(4, "new.1"))) == [(4, commands.Queue.BindOk)]
    assert _stored_keys(harness) == {"kept", "new.1"}


def test_a_refused_declare_of_the_group_leaves_no_queue(harness: Harness) -> None:
    peer = _client(harness)
    _disk_full(harness)
    frames = peer.exchange(
        encode(1, commands.Queue.Declare(queue="grp.new", durable=True))
        + publish(1, "grp.new", b"m")
    )
    assert [type(f) for _, f in frames] == [commands.Channel.Close]
    assert "grp.new" not in harness.vhost.queues


def test_a_group_is_one_record_read_back_whole_and_a_torn_one_is_not_read(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path)
    journal.open()
    journal.save_delta(DefinitionsDelta(add_queues=[QueueDef(name="q", qid=1)], next_qid=2))
    group = [
        DefinitionsDelta(add_bindings=[BindingDef(exchange="x", queue="q", routing_key=f"k{i}")])
        for i in range(50)
    ]
    journal.save_deltas(group)
    journal._simulate_crash()
    loaded = deflog.load(tmp_path)
    assert loaded.log_records == 2
    assert len(loaded.state.bindings) == 50
    # A crash in the middle of the group's write: none of it (nothing was acknowledged).
    log = tmp_path / deflog.LOG
    log.write_bytes(log.read_bytes()[:-100])
    torn = deflog.load(tmp_path)
    assert torn.log_records == 1 and torn.torn_bytes and not torn.state.bindings


def test_kill_9_in_the_middle_of_pipelined_binds_keeps_a_prefix_and_every_acknowledged_one(
    tmp_path: Path,
) -> None:
    """A real broker (fsync on) and a client pipelining 30,000 durable binds: killed once
    2,000 bind-oks are in, the topology on disk is the first m binds for some m >= 2,000
    (group commits land whole and in order), and the broker starts from it again."""
    data = tmp_path / "data"
    broker = BrokerProcess(data, name="groupkill").start()
    total, acked_before_kill = 30_000, 2_000
    keys = [f"k.{i}" for i in range(total)]
    try:
        with RawClient(broker.host, broker.port, timeout=30) as client:
            client.handshake()
            client.open_channel(1)
            client.send(
                encode(
                    1, commands.Exchange.Declare(exchange=EX, exchange_type="direct", durable=True)
                )
                + encode(1, commands.Queue.Declare(queue=Q, durable=True))
            )
            client.expect(commands.Exchange.DeclareOk, 1)
            client.expect(commands.Queue.DeclareOk, 1)

            def send_all() -> None:
                # In writes of 100 binds, from a thread of its own: the replies are read
                # meanwhile (the broker stops reading a client that does not read).
                with contextlib.suppress(OSError):
                    for start in range(0, total, 100):
                        client.send(b"".join(_bind(1, k) for k in keys[start : start + 100]))

            sender = threading.Thread(target=send_all, daemon=True)
            sender.start()
            for _ in range(acked_before_kill):
                client.expect(commands.Queue.BindOk, 1)
            broker.kill()
        sender.join(30)
        stored = {b.routing_key for b in deflog.load(data / "journal").state.bindings.values()}
        m = len(stored)
        print(f"{m} of {total} binds on disk after the kill, {acked_before_kill} acknowledged")
        assert m >= acked_before_kill
        assert stored == set(keys[:m]), "not a prefix of the binds sent"
        broker = BrokerProcess(data, name=broker.name, port=broker.port).start()
        with RawClient(broker.host, broker.port) as client:
            client.handshake()
            client.open_channel(1)
            client.send(encode(1, commands.Queue.Declare(queue=Q, durable=True, passive=True)))
            client.expect(commands.Queue.DeclareOk, 1)
        recovered = deflog.load(data / "journal").state.bindings.values()
        assert {b.routing_key for b in recovered} == set(keys[:m])
    finally:
        broker.stop()


def test_a_message_routed_into_a_queue_whose_declare_the_disk_refused_is_nacked(
    harness: Harness,
) -> None:
    """Another channel publishes into the queue in the same read: the declare is refused
    and undone, so the message, journaled, would be dropped by recovery (its queue is not
    in the topology): its batch fails with the group, the publish is nacked."""
    peer = _client(harness, channels=2)
    peer.feed(encode(2, commands.Confirm.Select()))
    _disk_full(harness)
    persistent = commands.Basic.Properties(delivery_mode=2)
    out = peer.feed(
        encode(1, commands.Queue.Declare(queue="grp.new", durable=True))
        + publish(2, "grp.new", b"m", properties=persistent)
    )
    harness.commit()
    out += peer.conn.data_to_send()
    assert _types(out) == [(1, commands.Channel.Close), (2, commands.Basic.Nack)]
