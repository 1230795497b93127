"""The replicated pair, one behaviour at a time: real broker processes on loopback, pika clients.

Each test starts its own pair (`jepsen.Pair`: broker `a` active, `b` passive,
replicating through a proxy the test controls) and drives it the way the
operator does, through the admin API. The fault suite
(`test_replication_faults.py`) runs the same pair under random faults.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from jepsen import queue_counts
from pamqp import commands
from pika.adapters.blocking_connection import BlockingChannel
from replpeer import hello_for

from twinmq.broker.admin_client import AdminUnreachable, metric_samples
from twinmq.broker.names import REPLICATION_TOKEN_ENV
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    Challenge,
    FrameDecoder,
    FrameType,
    Snapshot,
    decode_batch,
    encode,
    encode_u64,
)
from twinmq.operator.probe import passive_lag
from twinmq.testing.amqpclient import AMQPClient
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, post_role, stable_port, status
from twinmq.testing.rawamqp import RawClient, handshake_frames
from twinmq.testing.waiting import wait_for

QUEUE = "replicated"
TOKEN = Pair.TOKEN


@pytest.fixture
def pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A started pair; `@pytest.mark.parametrize("pair", [seconds], indirect=True)` sets
    its replication timeout (default 2 s)."""
    timeout = getattr(request, "param", 2.0)
    with Pair(tmp_path, replication_timeout=timeout) as started:
        yield started


def _channel(broker: BrokerProcess) -> tuple[pika.BlockingConnection, BlockingChannel]:
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    channel = connection.channel()
    channel.queue_declare(QUEUE, durable=True)
    return connection, channel


def publish(broker: BrokerProcess, bodies: list[bytes]) -> None:
    """Publish persistent messages with confirms; returns once every one is confirmed."""
    connection, channel = _channel(broker)
    try:
        channel.confirm_delivery()
        for body in bodies:
            channel.basic_publish("", QUEUE, body, pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def drain(broker: BrokerProcess, limit: int | None = None) -> list[bytes]:
    """basic.get (and ack) until the queue is empty or `limit` messages were taken."""
    connection, channel = _channel(broker)
    got: list[bytes] = []
    try:
        while limit is None or len(got) < limit:
            method, _, body = channel.basic_get(QUEUE)
            if method is None:
                break
            got.append(body)
            channel.basic_ack(method.delivery_tag)
    finally:
        connection.close()
    return got


def messages(broker: BrokerProcess) -> int | None:
    """Ready + unacked messages of the test queue in the broker's status."""
    counts = queue_counts(status(broker), QUEUE)
    return None if counts is None else sum(counts)


def replication(broker: BrokerProcess) -> dict[str, Any]:
    """The `replication` section of the broker's status."""
    data = status(broker)
    assert data is not None, f"{broker.name} does not answer"
    section: dict[str, Any] = data["replication"]
    return section


def metric(broker: BrokerProcess, name: str) -> float | None:
    """One unlabelled sample from `GET /metrics`."""
    try:
        return metric_samples(broker.admin.metrics(timeout=2)).get(name)
    except AdminUnreachable:
        return None


def promote(pair: Pair) -> None:
    """The operator's failover after the active died: promote the ready passive."""
    wait_for("passive ready", lambda: replication(pair.passive)["ready"], 5)
    pair.promote_passive()


def bodies(prefix: str, n: int) -> list[bytes]:
    """`n` distinct message bodies."""
    return [f"{prefix}-{i}".encode() for i in range(n)]


# -- delayed completion and failover --------------------------------------------------------


def test_confirmed_messages_are_on_the_passive_and_survive_kill_and_promotion(pair: Pair) -> None:
    sent = bodies("m", 300)
    publish(pair.active, sent)
    # A confirm is sent only once the passive has the message: no waiting here.
    assert messages(pair.passive) == 300
    old = pair.active
    old.kill()
    promote(pair)
    assert pair.active.name == "b"
    data = status(pair.active)
    assert data is not None and data["role"] == "active" and data["epoch"] == 2
    assert drain(pair.active) == sent  # all of them, in order
    assert old.name == "a"


def test_a_promoted_passive_flags_every_message_redelivered(pair: Pair) -> None:
    """Deliveries are not replicated: any message the promoted passive holds may have
    been delivered by the old active (here one was, unacknowledged, when it died), so
    each is flagged, as recovery from disk flags them."""
    publish(pair.active, bodies("m", 3))
    connection, ch = _channel(pair.active)
    method, _, body = ch.basic_get(QUEUE)
    assert method is not None and body == b"m-0" and not method.redelivered  # not acked
    old = pair.active
    old.kill()
    promote(pair)
    connection, ch = _channel(pair.active)
    flags = []
    while (got := ch.basic_get(QUEUE, auto_ack=True))[0] is not None:
        flags.append((got[2], got[0].redelivered))
    connection.close()
    assert flags == [(b"m-0", True), (b"m-1", True), (b"m-2", True)]


def test_acked_messages_are_removed_on_the_passive(pair: Pair) -> None:
    publish(pair.active, bodies("m", 100))
    taken = drain(pair.active, limit=40)
    assert len(taken) == 40
    # Dequeues are replicated by ID, asynchronously: wait for them.
    wait_for("dequeues on the passive", lambda: messages(pair.passive) == 60, 5)
    pair.active.kill()
    promote(pair)
    assert drain(pair.active) == bodies("m", 100)[40:]


# -- roles and epochs -----------------------------------------------------------------------


def test_passive_refuses_clients_with_320_naming_the_active(pair: Pair) -> None:
    with RawClient(pair.passive.host, pair.passive.port) as client:
        header, start_ok, tune_ok_open = handshake_frames()
        client.send(header)
        client.expect(commands.Connection.Start, 0)
        client.send(start_ok)
        client.expect(commands.Connection.Tune, 0)
        client.send(tune_ok_open)
        close = client.expect_connection_close(320)
    text = close.reply_text
    assert "passive" in text
    assert f"connect to the active broker: a ({pair.link.address})" in text, text
    # A real client sees the same refusal.
    with pytest.raises(pika.exceptions.AMQPConnectionError, match="320"):
        pika.BlockingConnection(pika.URLParameters(pair.passive.url))


def test_stale_epoch_is_refused_with_409_and_changes_nothing(pair: Pair) -> None:
    publish(pair.active, bodies("m", 10))
    before = {b.name: status(b) for b in (pair.active, pair.passive)}
    # Activation needs a new epoch; an older epoch is refused outright.
    code, body = post_role(pair.passive, "active", 1)
    assert code == 409 and body["error"] == "stale epoch"
    code, body = post_role(pair.active, "passive", 0, pair.link.address)
    assert code == 409 and "stale" in body["detail"]
    for broker in (pair.active, pair.passive):
        after = status(broker)
        assert after is not None
        was = before[broker.name]
        assert was is not None
        assert (after["role"], after["epoch"]) == (was["role"], was["epoch"])
    assert replication(pair.passive)["ready"]
    publish(pair.active, bodies("n", 10))
    assert messages(pair.passive) == 20


def test_active_steps_down_when_a_passive_knows_a_higher_epoch(tmp_path: Path) -> None:
    env = {REPLICATION_TOKEN_ENV: TOKEN}
    old = BrokerProcess(
        tmp_path / "old", name="old", env=env, port=stable_port(), admin_port=stable_port(),
        replication_port=stable_port(), extra_args=["--epoch", "1"],
    )  # fmt: skip
    with old:
        _connection, channel = _channel(old)
        newer = BrokerProcess(
            tmp_path / "newer", name="newer", env=env, port=stable_port(),
            admin_port=stable_port(), replication_port=stable_port(),
            extra_args=["--role", "passive", "--replicate-from", old.replication_address,
                        "--epoch", "3"],
        )  # fmt: skip
        with newer:
            wait_for(
                "old active stepped down",
                lambda: (s := status(old)) is not None and s["role"] == "passive",
                10,
            )
            data = status(old)
            assert data is not None and data["epoch"] == 3
            # Its clients are gone and new ones are refused.
            with pytest.raises(pika.exceptions.AMQPError):
                channel.queue_declare(QUEUE, durable=True)
            with pytest.raises(pika.exceptions.AMQPConnectionError, match="320"):
                pika.BlockingConnection(pika.URLParameters(old.url))
    # The higher epoch was persisted: a restart does not forget it.
    old.extra_args = ["--role", "passive", "--epoch", "1"]
    with old.start():
        data = status(old)
        assert data is not None and data["epoch"] == 3


# -- catch-up -------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", [1.0], indirect=True)
def test_catch_up_after_passive_restart_sends_only_what_is_missing(pair: Pair) -> None:
    publish(pair.active, bodies("before", 300))
    passive = pair.passive
    passive.kill()
    # The active waits replication_timeout for its passive, then goes on alone.
    publish(pair.active, bodies("during", 200))
    assert replication(pair.active)["degraded"]
    log_size = pair.active.log_path.stat().st_size if pair.active.log_path else 0
    passive.start()
    pair.wait_healthy(10)
    assert messages(passive) == 500
    assert pair.active.log_path is not None
    with open(pair.active.log_path) as log:
        log.seek(log_size)
        lines = log.readlines()
    attached = [line for line in lines if "attached: catch-up" in line]
    assert len(attached) == 1, attached
    done = [line for line in lines if "caught up in" in line]
    assert len(done) == 1, done
    assert "catch-up sent 200 messages, discarded 0, kept 300" in done[0], done[0]
    assert not replication(pair.active)["degraded"]


@pytest.mark.parametrize("pair", [1.0], indirect=True)
def test_stopped_passive_does_not_block_the_active_and_catches_up(pair: Pair) -> None:
    publish(pair.active, bodies("before", 50))
    pair.passive.signal(signal.SIGSTOP)
    try:
        # Confirms wait at most replication_timeout for the silent passive.
        publish(pair.active, bodies("alone", 100))
        section = replication(pair.active)
        assert section["degraded"] and not section["ready"]
    finally:
        pair.passive.signal(signal.SIGCONT)
    pair.wait_healthy(10)
    assert not replication(pair.active)["degraded"]
    assert messages(pair.passive) == 150
    publish(pair.active, bodies("after", 10))
    assert messages(pair.passive) == 160


@pytest.mark.parametrize("pair", [120.0], indirect=True)
def test_a_paused_passive_is_lag_in_the_actives_status_and_the_operators(pair: Pair) -> None:
    """What the operator's `status.brokers[].lagMessages` reports for a passive that cannot
    answer: the active's count of messages sent and not yet durable on it."""
    publish(pair.active, bodies("before", 10))
    assert pair.active.admin.status().replication.lag_messages == 0
    pair.passive.signal(signal.SIGSTOP)
    connection, channel = _channel(pair.active)
    try:
        for body in bodies("held", 30):  # no confirms: they wait for the paused passive
            channel.basic_publish("", QUEUE, body, pika.BasicProperties(delivery_mode=2))
        report = wait_for(
            "the active to count the held messages",
            lambda: (r := pair.active.admin.status()).replication.lag_messages >= 30 and r,
            10,
        )
        lag = passive_lag("backup", "primary", {"primary": report, "backup": None})
        assert lag[0] == report.replication.lag_messages >= 30
        assert passive_lag("primary", "primary", {"primary": report, "backup": None}) == (0, 0.0)
    finally:
        pair.passive.signal(signal.SIGCONT)
        connection.close()
    wait_for(
        "the lag to clear", lambda: pair.active.admin.status().replication.lag_messages == 0, 10
    )
    assert messages(pair.passive) == 40


@pytest.mark.parametrize("pair", [1.0], indirect=True)
def test_returning_old_active_discards_what_the_new_active_does_not_have(pair: Pair) -> None:
    publish(pair.active, bodies("shared", 50))
    old, new = pair.active, pair.passive
    pair.link.cut()
    publish(old, bodies("only-on-a", 20))  # confirmed by a alone (degraded) after the timeout
    old.kill()
    # b is not ready: promoting it now is a loss the operator accepts (allowDataLoss).
    assert not replication(new)["ready"]
    pair.link.heal()
    pair.epoch += 1
    code, _ = post_role(new, "active", pair.epoch)
    assert code == 200
    pair.active_name, pair.passive_name = "b", "a"
    pair.link.retarget(new.replication_address)
    publish(new, bodies("on-b", 10))
    old.extra_args = pair.args("passive")
    log_size = old.log_path.stat().st_size if old.log_path else 0
    old.start()
    pair.wait_healthy(10)
    assert messages(old) == messages(new) == 60
    assert new.log_path is not None and old.log_path is not None
    assert "catch-up sent 10 messages, discarded 20, kept 50" in new.log_path.read_text()
    assert log_size < old.log_path.stat().st_size
    # a, promoted in turn, holds exactly what b held.
    new.kill()
    promote(pair)
    assert drain(old) == bodies("shared", 50) + bodies("on-b", 10)


# -- the passive's readiness ----------------------------------------------------------------


@pytest.mark.parametrize("pair", [1.0], indirect=True)
def test_passive_cut_off_from_the_active_stops_claiming_ready(pair: Pair) -> None:
    publish(pair.active, bodies("m", 10))
    assert replication(pair.passive)["ready"]
    assert metric(pair.active, "twinmq_replication_degraded") == 0
    pair.link.cut()
    # After replication_timeout the active goes on alone; by then b must not say ready.
    wait_for("going alone", lambda: metric(pair.active, "twinmq_replication_degraded") == 1, 5)
    assert not replication(pair.passive)["ready"]
    pair.link.heal()
    pair.wait_healthy(10)


@pytest.mark.parametrize("pair", [1.0], indirect=True)
def test_paused_then_demoted_active_confirms_nothing_its_passive_lacks(pair: Pair) -> None:
    """The old active of a failover runs again (SIGCONT) and is demoted (POST /role).

    A publish it holds that the passive never acknowledged must not be
    confirmed: not because its own freeze looked like the passive's stall, and
    not on the way out when it drops the passive.
    """
    old, new = pair.active, pair.passive

    async def scenario() -> tuple[list[tuple[int, bool, bool]], str]:
        # No heartbeats: the client must stay connected through the active's freeze.
        client = await AMQPClient.connect(f"{old.host}:{old.port}", heartbeat=0)
        confirms: list[tuple[int, bool, bool]] = []
        first = asyncio.Event()

        def on_confirm(tag: int, multiple: bool, ack: bool) -> None:
            confirms.append((tag, multiple, ack))
            first.set()

        client.on_confirm = on_confirm
        await client.queue_declare(QUEUE)
        await client.confirm_select()
        client.publish(QUEUE, b"replicated")
        await asyncio.wait_for(first.wait(), 5)
        new.signal(signal.SIGSTOP)  # the next publish is never acknowledged ...
        client.publish(QUEUE, b"pending")
        await client.drain()
        await asyncio.sleep(0.2)  # (lets the active journal and stream it)
        old.signal(signal.SIGSTOP)  # ... and the active freezes well within the timeout
        await asyncio.sleep(3 * pair.replication_timeout)  # how long the fault lasts
        old.signal(signal.SIGCONT)
        code, body = await asyncio.to_thread(post_role, old, "passive", 2, pair.link.address)
        assert code == 200 and body["role"] == "passive", (code, body)
        await asyncio.wait_for(client.closed.wait(), 5)
        return confirms, str(client.error)

    try:
        confirms, error = asyncio.run(scenario())
    finally:
        new.signal(signal.SIGCONT)
    assert confirms == [(1, False, True)], "a publish the passive never had was confirmed"
    assert "320" in error and "now passive" in error


# -- recovery -------------------------------------------------------------------------------


def test_restarted_broker_routes_to_its_recovered_queues(tmp_path: Path) -> None:
    """A durable queue recovered from the journal is still bound to the default exchange."""
    broker = BrokerProcess(tmp_path / "data", name="restarted")
    with broker:
        publish(broker, [b"before"])
    with broker.start():
        publish(broker, [b"after"])
        assert drain(broker) == [b"before", b"after"]


@pytest.mark.parametrize("pair", [30.0], indirect=True)
def test_a_passive_replacing_its_old_link_does_not_release_confirms(pair: Pair) -> None:
    """A passive that reconnects before the active saw its old link die replaces it;
    what waited for the old link must then wait for the new one, not be confirmed."""
    active, passive = pair.active, pair.passive

    async def scenario() -> None:
        client = await AMQPClient.connect(f"{active.host}:{active.port}", heartbeat=0)
        confirms: list[int] = []
        confirmed = asyncio.Event()

        def on_confirm(tag: int, multiple: bool, ack: bool) -> None:
            confirms.append(tag)
            confirmed.set()

        client.on_confirm = on_confirm
        await client.queue_declare(QUEUE)
        await client.confirm_select()
        client.publish(QUEUE, b"first")
        await asyncio.wait_for(confirmed.wait(), 5)
        passive.signal(signal.SIGSTOP)  # its link stays up but never acknowledges again
        durable = _durable_batch(active)
        client.publish(QUEUE, b"pending")
        await asyncio.to_thread(
            wait_for, "pending on the active's disk", lambda: _durable_batch(active) > durable, 5
        )
        # A second passive (the same one, reconnecting, as far as the active knows).
        reader, writer = await asyncio.open_connection(active.host, active.replication_port)
        frames = _ReplicationFrames(reader)
        challenge = Challenge.model_validate_json(await frames.expect(FrameType.CHALLENGE))
        writer.write(encode(FrameType.HELLO, hello_for(TOKEN, challenge, "b", 1)))
        await frames.expect(FrameType.WELCOME)
        writer.write(encode(FrameType.SNAPSHOT, Snapshot()))
        chunk, flags, _ = decode_batch(await frames.expect(FrameType.BATCH))
        assert flags == BATCH_CATCHUP | BATCH_CATCHUP_LAST  # both messages, in one chunk
        await client.qos(10)  # a confirm released by the replacement would precede qos-ok
        assert confirms == [1], "a publish was confirmed with no passive holding it"
        writer.write(encode_u64(FrameType.CATCHUP_ACK, chunk))
        await frames.expect(FrameType.CAUGHT_UP)
        await asyncio.wait_for(_wait_for_confirm(confirms, 2), 5)
        writer.close()
        await client.close()

    try:
        asyncio.run(scenario())
    finally:
        passive.signal(signal.SIGCONT)


def _durable_batch(broker: BrokerProcess) -> int:
    data = status(broker)
    assert data is not None
    return int(data["journal"]["durable_batch"])


class _ReplicationFrames:
    """The frames a (fake) passive reads from the active."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.decoder = FrameDecoder()
        self.frames: list[tuple[FrameType, bytes]] = []

    async def expect(self, wanted: FrameType) -> bytes:
        """The payload of the next `wanted` frame (other frames are skipped)."""
        while True:
            while not self.frames:
                data = await asyncio.wait_for(self.reader.read(65536), 5)
                assert data, "the active closed the replication link"
                self.frames.extend(self.decoder.feed(data))
            ftype, payload = self.frames.pop(0)
            if ftype is wanted:
                return payload


async def _wait_for_confirm(confirms: list[int], tag: int) -> None:
    while tag not in confirms:  # noqa: ASYNC110 - the confirm callback sets no event here
        await asyncio.sleep(0.01)
