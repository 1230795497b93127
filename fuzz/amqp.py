"""The AMQP connection core under fuzzed input: a corpus of valid frames and the checks.

One fuzzed connection and one bystander (the canary) share a real virtual host over a
real journal (`twinmq.testing.sansio`). After any input the core must have answered
with well-formed frames and never an internal error, be open or closing having said
why, keep the bystander working, leave the queue bookkeeping consistent once the
fuzzed connection is gone, and hold definitions that load back at the next start
(a declare the broker accepted must never stop it from restarting).
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from pathlib import Path

from pamqp import commands
from pamqp.base import Frame as MethodFrame
from pamqp.common import FieldTable
from pamqp.frame import _unmarshal_method_frame

from twinmq.broker.connection import State
from twinmq.broker.definitions import Definitions
from twinmq.broker.errors import ReplyCode
from twinmq.broker.journal.recovery import decode_definitions, encode_definitions
from twinmq.broker.queue import LengthCap
from twinmq.testing.rawamqp import content, encode, handshake_frames, raw_frame, split_frames
from twinmq.testing.sansio import Harness, Peer

HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"

CAP = LengthCap(messages=8, bytes=16384)
"""The broker's queue length cap under the fuzzer: low enough for an input's few publishes
to meet it (refused copies, a transaction's commit refused), so those paths are fuzzed."""


def publish_parts(
    channel: int,
    routing_key: str,
    body: bytes,
    exchange: str = "",
    properties: commands.Basic.Properties | None = None,
) -> list[bytes]:
    """A publish as three separate frames, so mutations can drop or reorder them."""
    method = encode(channel, commands.Basic.Publish(exchange=exchange, routing_key=routing_key))
    header_and_body = content(channel, body, properties)
    header = split_frames(header_and_body)[0]
    header_frame = raw_frame(header[0], header[1], header[2])
    return [method, header_frame, header_and_body[len(header_frame) :]]


def _corpus() -> list[bytes]:
    C, Q, E, B, T = (
        commands.Channel,
        commands.Queue,
        commands.Exchange,
        commands.Basic,
        commands.Tx,
    )
    dlx_args: FieldTable = {"x-message-ttl": 0, "x-dead-letter-exchange": "fz-dlx"}
    methods: list[tuple[int, MethodFrame]] = [
        (1, Q.Declare(queue="fz")),
        (1, Q.Declare(queue="fz-durable", durable=True)),
        (1, Q.Declare(queue="", exclusive=True)),
        (1, Q.Declare(queue="fz-auto", auto_delete=True)),
        (1, Q.Declare(queue="fz-ttl", arguments=dlx_args)),
        (
            1,
            Q.Declare(
                queue="fz-max", arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
            ),
        ),
        (1, Q.Declare(queue="fz", passive=True)),
        (1, E.Declare(exchange="fz-dlx", exchange_type="fanout")),
        (1, E.Declare(exchange="fz-topic", exchange_type="topic", durable=True)),
        (1, E.Declare(exchange="fz-headers", exchange_type="headers")),
        (1, Q.Bind(queue="fz", exchange="fz-topic", routing_key="a.*")),
        (1, Q.Bind(queue="fz", exchange="fz-dlx")),
        (
            1,
            Q.Bind(
                queue="fz-durable", exchange="fz-headers", arguments={"x-match": "any", "k": "v"}
            ),
        ),
        (1, Q.Unbind(queue="fz", exchange="fz-topic", routing_key="a.*")),
        (1, B.Qos(prefetch_count=2)),
        (1, B.Qos(prefetch_count=1, global_=True)),
        (1, B.Consume(queue="fz", consumer_tag="c1")),
        (1, B.Consume(queue="fz-auto", consumer_tag="c2", no_ack=True)),
        (1, B.Cancel(consumer_tag="c1")),
        (1, B.Cancel(consumer_tag="c2")),
        (1, B.Get(queue="fz")),
        (1, B.Get(queue="fz-durable", no_ack=True)),
        (1, B.Ack(delivery_tag=1)),
        (1, B.Ack(delivery_tag=0, multiple=True)),
        (1, B.Nack(delivery_tag=2, requeue=True)),
        (1, B.Nack(delivery_tag=0, multiple=True, requeue=False)),
        (1, B.Reject(delivery_tag=1, requeue=False)),
        (1, B.Recover(requeue=True)),
        (1, T.Select()),
        (1, T.Commit()),
        (1, T.Rollback()),
        (1, commands.Confirm.Select()),
        (1, C.Flow(active=False)),
        (1, C.Flow(active=True)),
        (1, Q.Purge(queue="fz")),
        (1, Q.Delete(queue="fz")),
        (1, E.Delete(exchange="fz-topic")),
        (1, C.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)),
        (1, C.CloseOk()),
        (1, C.Open()),
        (2, C.Open()),
        (2, Q.Declare(queue="fz")),
        (2, B.Consume(queue="fz", consumer_tag="c3")),
        (3, B.Get(queue="fz")),
    ]
    frames = [encode(channel, method) for channel, method in methods]
    persistent = commands.Basic.Properties(delivery_mode=2, message_id="m-1")
    headers = commands.Basic.Properties(headers={"k": "v"}, expiration="0")
    for parts in (
        publish_parts(1, "fz", b"body"),
        publish_parts(1, "a.b", b"x" * 300, exchange="fz-topic"),
        publish_parts(1, "fz-durable", b"kept", properties=persistent),
        publish_parts(1, "", b"h", exchange="fz-headers", properties=headers),
        publish_parts(1, "fz-ttl", b"dead soon"),
        publish_parts(1, "fz-max", b"full"),
        publish_parts(2, "fz", b""),
    ):
        frames.append(b"".join(parts))
        frames.extend(part for part in parts if part)
    frames.append(HEARTBEAT)
    return frames


CORPUS: list[bytes] = _corpus()
"""Valid frames after the handshake on channel 1 (open), each alone or a publish whole."""


def chunked(data: bytes, cuts: Iterable[int]) -> Iterator[bytes]:
    """`data` split at the given offsets (any order, duplicates allowed)."""
    last = 0
    for cut in sorted({c % (len(data) + 1) for c in cuts}):
        yield data[last:cut]
        last = cut
    yield data[last:]


def check_output(output: bytes) -> list[tuple[int, MethodFrame]]:
    """The broker's output is well-formed frames; return its decoded method frames."""
    methods = []
    for ftype, channel, payload in split_frames(output):
        if ftype == 1:
            methods.append((channel, _unmarshal_method_frame(payload)))
    for _, method in methods:
        if isinstance(method, commands.Connection.Close | commands.Channel.Close):
            assert method.reply_code != ReplyCode.INTERNAL_ERROR, method.reply_text
    return methods


def check_state(peer: Peer, methods: list[tuple[int, MethodFrame]]) -> None:
    """Open, or closing/closed having told the client why."""
    state = peer.conn.state
    close, close_ok = commands.Connection.Close, commands.Connection.CloseOk
    # The connection's ends on channel 0, in the order sent.
    ends = [type(m) for ch, m in methods if ch == 0 and isinstance(m, close | close_ok)]
    if state is State.OPEN:
        assert not ends
    elif state is State.CLOSING:
        assert ends.count(close) == 1
    else:
        assert state is State.CLOSED, state
        # The broker closed (and said why) and got close-ok; or the client closed and got
        # close-ok; or both at once: the spec's answer to a close received after sending
        # one is close-ok, so ours comes after our close.
        assert ends in ([close], [close_ok], [close, close_ok]), methods
    for number, channel in peer.conn.channels.items():
        assert 1 <= number <= peer.conn.channel_max and channel.number == number


@cache
def _opening() -> tuple[bytes, ...]:
    # Encoded once: pamqp's encoder would otherwise cost a third of a fuzzed input.
    return (*handshake_frames(), encode(1, commands.Channel.Open()))


def open_peer(harness: Harness) -> Peer:
    """A loopback client past the handshake (guest, PLAIN), channel 1 open."""
    peer = harness.connect()
    for step in _opening():
        peer.feed(step)
    assert peer.conn.state is State.OPEN
    return peer


@cache
def _canary_frames(body: bytes) -> tuple[bytes, bytes]:
    # Encoded once per body: pamqp's encoder is instrumented, and slow, under the fuzzer.
    publish = b"".join(publish_parts(1, "canary", body))
    return publish, encode(1, commands.Basic.Get(queue="canary", no_ack=True))


def canary_round_trip(canary: Peer, body: bytes) -> None:
    """The bystander connection publishes to its exclusive queue and gets the message back."""
    publish, get = _canary_frames(body)
    assert canary.feed(publish) == b""
    answer = split_frames(canary.feed(get))  # well-formed frames: get-ok, header, body
    assert [ftype for ftype, _, _ in answer] == [1, 2, 3], answer
    assert isinstance(_unmarshal_method_frame(answer[0][2]), commands.Basic.GetOk), answer
    assert struct.unpack_from(">Q", answer[1][2], 4)[0] == len(body), answer
    assert answer[2][2] == body, answer


def check_vhost(harness: Harness) -> None:
    """Queue bookkeeping adds up once the fuzzed connection is gone."""
    for queue in harness.vhost.queues.values():
        assert queue.unacked == 0, (queue.name, queue.unacked)
        assert queue.bytes == sum(entry.size for entry in queue.entries), queue.name
        assert not queue.consumers, queue.name


def check_definitions_reload(harness: Harness) -> None:
    """The topology as the broker would save it now reads back at the next start."""
    _check_reload(harness.vhost.definitions())


def _check_reload(saved: Definitions) -> None:
    back = decode_definitions(encode_definitions(saved), Path("definitions.json"))
    # As stored: a value read back as another type that compares equal (1 as True, a
    # Decimal as an int) fails here.
    stored = saved.model_dump_json()
    assert back.model_dump_json() == stored, "the topology is stored otherwise once read back"
    # And with ==: an encoding that collapses two types (bytes and str, once) passes the
    # first. A NaN argument is never equal to itself: that input is judged as stored.
    assert back == saved or '"__float__"' in stored, "the topology reads back otherwise"


class ReloadCheck:
    """`check_definitions_reload`, skipped when the durable topology is one it checked.

    Saving and loading back (JSON out, JSON and pydantic in, two checksums) is most of
    an input's cost, and most inputs leave the durable exchanges, queues and bindings
    as they were: the same values read back the same. What is compared is their reprs
    (types included); `next_qid`, which every declare raises, is a
    counter of the broker's own (no client byte reaches it), so it alone changing does
    not make a topology new.
    """

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.checked: list[str] = []  # the baseline, then the latest

    def __call__(self) -> None:
        """Check the topology unless it is the baseline or the last one checked."""
        saved = self.harness.vhost.definitions()
        # By repr, not ==: 1, 1.0, True and Decimal(1) are equal, and store differently.
        key = repr((saved.exchanges, saved.queues, saved.bindings))
        if key in self.checked:
            return
        _check_reload(saved)
        self.checked[1:] = [key]


def canary_peer(harness: Harness) -> Peer:
    """The bystander: a connection with its exclusive queue `canary`."""
    canary = open_peer(harness)
    canary.feed(encode(1, commands.Queue.Declare(queue="canary", exclusive=True)))
    return canary


def fuzz_connection(streams: list[bytes], cuts: Iterable[int]) -> None:
    """Feed the streams to one connection on a fresh virtual host, then check everything."""
    with tempfile.TemporaryDirectory() as tmp:
        harness = Harness(Path(tmp), queue_cap=CAP)
        try:
            canary = canary_peer(harness)
            run_one(harness, canary, streams, list(cuts))
        finally:
            harness.close()


def run_one(
    harness: Harness,
    canary: Peer,
    streams: list[bytes],
    cuts: list[int],
    reload_check: Callable[[], None] | None = None,
) -> None:
    """One fuzzed connection's whole life on `harness`, checked (see the module).

    `reload_check`: checks the definitions load back (default: every time).
    """
    fuzzed = open_peer(harness)
    output = b""
    for stream in streams:
        for chunk in chunked(stream, cuts):
            output += fuzzed.feed(chunk)
            harness.clock.advance(0.5)  # let TTL timers fire between chunks
    check_state(fuzzed, check_output(output))
    harness.commit()
    check_output(fuzzed.conn.data_to_send())
    assert canary.conn.state is State.OPEN
    canary_round_trip(canary, b"still here")
    if reload_check is None:
        check_definitions_reload(harness)
    else:
        reload_check()
    fuzzed.conn.connection_lost()
    check_vhost(harness)
    assert "canary" in harness.vhost.queues
    canary_round_trip(canary, b"and after")


class _FuzzHarness(Harness):
    """`Harness` whose `commit` with nothing outstanding is one turn of the loop.

    `Harness.commit` runs a task with a timeout on the loop every time: a fifth of an
    input's cost, although group commit has nothing to wait for after most inputs.
    """

    def commit(self, timeout: float = 5.0) -> None:
        """Wait for group commit when it has work; else let the loop run what is ready."""
        if self.committer.confirm_point():
            super().commit(timeout)
            return
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()


class ConnectionFuzzer:
    """`run_one` on one long-lived virtual host, reset between inputs (fuzzing speed).

    A fresh journal and event loop per input costs ~9 ms; this costs a fraction of a
    millisecond. Between inputs every queue and exchange the input made is removed, so
    an input's outcome does not depend on earlier ones (a finding replays alone through
    `fuzz_connection`). The definitions are checked to load back only when the durable
    topology is new (`ReloadCheck`).
    """

    def __init__(self, directory: Path) -> None:
        self.harness = _FuzzHarness(directory, queue_cap=CAP)
        self.canary = canary_peer(self.harness)
        self.queues = set(self.harness.vhost.queues)
        self.exchanges = set(self.harness.vhost.exchanges)
        self.reload_check = ReloadCheck(self.harness)
        self.reload_check()  # the baseline, kept

    def one_input(self, stream: bytes, cuts: list[int]) -> None:
        """Check one input, then undo what it declared."""
        harness = self.harness
        run_one(harness, self.canary, [stream], cuts, self.reload_check)
        vhost = harness.vhost
        for name in set(vhost.queues) - self.queues:
            vhost.remove_queue(vhost.queues[name])
        for name in set(vhost.exchanges) - self.exchanges:
            vhost.delete_exchange(name, if_unused=False)
        harness.commit()
        harness.peers[:] = [self.canary]

    def close(self) -> None:
        """Release the journal and the event loop."""
        self.harness.close()
