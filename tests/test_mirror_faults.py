"""The DR mirror under faults: kill -9 of either site, re-sent events, a mirror that is
away or stalled. Real broker processes; the raw-link test speaks the mirror protocol
itself to re-send what the mirror already applied."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from mirrorsites import ORIGIN, TOKEN, Sites, metric, mirror_status, publish, queues

from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.journal import StoredMessage
from twinmq.broker.mirror.auth import Transcript, mirror_key
from twinmq.broker.mirror.events import encode_definitions_event, encode_ops_event, record_header
from twinmq.broker.replication.handshake import new_nonce
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import (
    Challenge,
    FrameType,
    Hello,
    Welcome,
    decode_model,
    decode_u64,
    encode,
    encode_batch,
)
from twinmq.testing.pair import status
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    with Sites(tmp_path) as started:
        yield started


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_a_source_killed_with_events_pending_loses_and_duplicates_nothing(sites: Sites) -> None:
    sites.mirror.stop()  # events pile up in the source's replication queue
    publish(sites.source, "pending", bodies("m", 400))
    assert len(drain(sites.source.url, "pending")) == 400  # consume all ...
    publish(sites.source, "pending", bodies("n", 300))  # ... then 300 more stay
    pending = mirror_status(sites.source)
    assert pending is not None and pending["queue_events"] > 0 and not pending["connected"]
    sites.source.kill()
    sites.source.start()
    sites.mirror.start()
    sites.caught_up()
    assert drain(sites.mirror.url, "pending") == bodies("n", 300)


def test_a_source_killed_while_streaming_leaves_every_confirmed_message_once_on_the_mirror(
    sites: Sites,
) -> None:
    publish(sites.source, "stream", bodies("x", 1500))
    sites.source.kill()  # whatever was in flight or unacknowledged is re-sent
    sites.source.start()
    publish(sites.source, "stream", bodies("y", 100))
    sites.caught_up()
    assert drain(sites.mirror.url, "stream") == bodies("x", 1500) + bodies("y", 100)


def test_a_mirror_killed_and_restarted_ends_with_exactly_the_source_messages(
    sites: Sites,
) -> None:
    publish(sites.source, "restart", bodies("a", 300))
    sites.mirror.kill()
    publish(sites.source, "restart", bodies("b", 300))
    sites.mirror.start()
    sites.caught_up()
    assert queues(sites.mirror)["restart"]["messages"] == 600
    assert drain(sites.mirror.url, "restart") == bodies("a", 300) + bodies("b", 300)


def test_a_disconnected_mirror_never_slows_producers(tmp_path: Path) -> None:
    with Sites(tmp_path, source_args=["--mirror-max-lag", "0.2"]) as sites:
        sites.mirror.stop()
        publish(sites.source, "busy", bodies("early", 10))
        wait_for(
            "events older than the lag bound",
            lambda: (mirror_status(sites.source) or {}).get("oldest_event_age_seconds", 0) > 1,
            30,
        )
        params = pika.ConnectionParameters(port=sites.source.port, blocked_connection_timeout=5)
        connection = pika.BlockingConnection(params)
        ch = connection.channel()
        ch.confirm_delivery()
        for body in bodies("late", 200):
            ch.basic_publish("", "busy", body, pika.BasicProperties(delivery_mode=2))
        connection.close()
        section = mirror_status(sites.source)
        assert section is not None and not section["flow_control"]
        data = status(sites.source)
        assert data is not None and data["alarms"] == []


def test_a_connected_mirror_that_stops_acknowledging_blocks_producers_until_it_catches_up(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path, source_args=["--mirror-max-lag", "0.5"]) as sites:
        publish(sites.source, "lagging", bodies("before", 10))
        sites.caught_up()
        sites.mirror.signal(signal.SIGSTOP)  # connected, but nothing is acknowledged
        try:
            publish(sites.source, "lagging", bodies("stalled", 10))
            wait_for(
                "mirror flow control on",
                lambda: (status(sites.source) or {}).get("alarms") == ["mirror-lag"],
                30,
            )
        finally:
            sites.mirror.signal(signal.SIGCONT)
        sites.caught_up()
        wait_for("flow control off", lambda: (status(sites.source) or {}).get("alarms") == [], 30)
        assert queues(sites.mirror)["lagging"]["messages"] == 20


def test_the_mirror_metrics_show_enabled_connected_depth_and_age(sites: Sites) -> None:
    publish(sites.source, "metered", bodies("m", 5))
    sites.caught_up()
    assert metric(sites.source, "twinmq_mirror_enabled") == 1
    assert metric(sites.source, "twinmq_mirror_connected") == 1
    assert metric(sites.source, "twinmq_mirror_queue_events") == 0
    assert metric(sites.mirror, "twinmq_mirror_enabled") == 0
    assert (metric(sites.mirror, "twinmq_mirror_applied_events_total") or 0) >= 2
    sites.mirror.stop()
    publish(sites.source, "metered", bodies("n", 5))
    wait_for("link down", lambda: metric(sites.source, "twinmq_mirror_connected") == 0, 30)
    assert (metric(sites.source, "twinmq_mirror_queue_events") or 0) >= 1
    assert (metric(sites.source, "twinmq_mirror_queue_bytes") or 0) > 0
    assert (metric(sites.source, "twinmq_mirror_oldest_event_age_seconds") or 0) > 0


# -- the mirror protocol spoken by the test: a source that re-sends ------------------------


class RawSource:
    """A mirror link opened by hand: handshake, events out, acks in."""

    def __init__(self, address: str, origin: str) -> None:
        self.address = address
        self.origin = origin

    async def __aenter__(self) -> RawSource:
        host, _, port = self.address.rpartition(":")
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        self.frames = FrameReader(self.reader, "mirror")
        ftype, payload = await self.frames.next(10)
        assert ftype is FrameType.CHALLENGE
        challenge = decode_model(Challenge, payload)
        nonce = new_nonce()
        key = mirror_key(TOKEN)
        transcript = Transcript(challenge.name, self.origin, challenge.nonce, nonce)
        hello = Hello(name=self.origin, epoch=0, nonce=nonce, proof=transcript.proof(key, "source"))
        self.writer.write(encode(FrameType.HELLO, hello))
        ftype, payload = await self.frames.next(10)
        assert ftype is FrameType.WELCOME, f"{ftype.name}: {payload!r}"
        assert transcript.refusal(key, decode_model(Welcome, payload).proof, "mirror") is None
        self.frames.authenticated()
        self.mark = await self.ack()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def ack(self) -> int:
        while True:
            ftype, payload = await self.frames.next(30)
            if ftype is FrameType.ACK:
                return decode_u64(payload)
            assert ftype is not FrameType.REFUSE, f"REFUSE: {payload!r}"

    async def send(self, events: list[tuple[int, bytes]]) -> int:
        """Send events; the mirror's ack of the last one."""
        for seq, body in events:
            self.writer.write(encode_batch(seq, 0, body))
        while (acked := await self.ack()) < events[-1][0]:
            pass
        return acked


def test_a_re_sent_batch_applies_nothing_twice_even_after_a_mirror_restart(sites: Sites) -> None:
    sites.source.stop()  # the test speaks for the source's origin from now on
    qid = 7
    topology = Definitions(queues=[QueueDef(name="raw", qid=qid)], next_qid=qid + 1)

    def message(mid: int) -> bytes:
        body = f"raw-{mid}".encode()
        op = StoredMessage(mid, qid, "", "raw", record_header(len(body)), body, None)
        return encode_ops_event([op], 0.0)

    async def run() -> tuple[int, int]:
        async with RawSource(sites.mirror_address, ORIGIN) as link:
            start = link.mark
            first = [
                (start + 1, encode_definitions_event(topology, 0.0)),
                (start + 2, message(1)),
                (start + 3, message(2)),
            ]
            assert await link.send(first) == start + 3
        sites.mirror.kill()
        sites.mirror.start()
        async with RawSource(sites.mirror_address, ORIGIN) as link:
            remembered = link.mark
            # The link was cut after the apply: a source that never saw the ack re-sends.
            assert await link.send([*first, (start + 4, message(3))]) == start + 4
        return start, remembered

    start, remembered = asyncio.run(run())
    assert remembered == start + 3
    assert drain(sites.mirror.url, "raw") == [b"raw-1", b"raw-2", b"raw-3"]


def test_a_mirror_takes_one_origin_and_refuses_another(sites: Sites) -> None:
    sites.caught_up()  # the mirror holds the source's mark

    async def other() -> None:
        async with RawSource(sites.mirror_address, "some-other-site"):
            pass

    with pytest.raises(AssertionError, match="REFUSE"):
        asyncio.run(other())
