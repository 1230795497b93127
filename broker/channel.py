"""One AMQP channel: content assembly, consumers, deliveries, acks, confirms, transactions.

Sans-I/O: a channel turns decoded frames into calls on the virtual host and
bytes for its connection's output buffer.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pamqp import commands
from pamqp.base import Frame as MethodFrame

from twinmq.broker import metrics
from twinmq.broker.codec import (
    Ack,
    ContentHeaderInfo,
    Publish,
    decode_content_header,
    encode_basic_ack,
    encode_basic_nack,
    encode_content,
    encode_declare_ok,
    encode_deliver,
    encode_get_ok,
    encode_method,
    encode_return,
)
from twinmq.broker.errors import AMQPError, ReplyCode, channel_error
from twinmq.broker.federation.headers import MARK, stamp_origin, strip_federation
from twinmq.broker.federation.identity import PEER_EXCHANGE
from twinmq.broker.journal import JournalOp
from twinmq.broker.message import Entry
from twinmq.broker.mirror.events import is_internal
from twinmq.broker.permissions import DEFAULT_EXCHANGE, SERVER_NAMED_QUEUE
from twinmq.broker.queue import Queue

if TYPE_CHECKING:
    from twinmq.broker.connection import Connection
    from twinmq.broker.vhost import StagedChange

BASIC_ACK = (60, 80)
BASIC_REJECT = (60, 90)
BASIC_NACK = (60, 120)


class ChannelConsumer:
    """A `basic.consume` subscription of a channel."""

    __slots__ = (
        "channel",
        "exclusive",
        "no_ack",
        "prefetch",
        "queue",
        "tag",
        "tag_bytes",
        "unacked",
    )

    def __init__(
        self,
        channel: Channel,
        queue: Queue,
        tag: str,
        no_ack: bool,
        exclusive: bool,
        prefetch: int,
    ) -> None:
        self.channel = channel
        self.queue = queue
        self.tag = tag
        self.tag_bytes = tag.encode()
        self.no_ack = no_ack
        self.exclusive = exclusive
        self.prefetch = prefetch
        self.unacked = 0

    def ready(self) -> bool:
        """Prefetch credit left, channel flow on, connection not backed up."""
        ch = self.channel
        if not ch.flow_active or not ch.connection.writable or ch.closing:
            return False
        if self.no_ack:
            return True
        if self.prefetch and self.unacked >= self.prefetch:
            return False
        return not (ch.global_prefetch and len(ch.unacked) >= ch.global_prefetch)

    def deliver(self, queue: Queue, entry: Entry) -> None:
        """Send the entry to the client."""
        self.channel.deliver(self, queue, entry)

    def cancelled_by_server(self) -> None:
        """The queue went away: tell the client if it asked to be told."""
        self.channel.server_cancel(self)


@dataclass(slots=True)
class PendingConfirm:
    """A publish (or a tx.commit) waiting for its batch to become durable."""

    seq: int
    batch: int
    kind: Literal["ack", "nack", "commit", "commit-failed"]
    started: float
    # An earlier batch whose failure fails this confirm too (a re-send that shares its
    # original's outcome, `batch` raised to keep the channel's confirms in order); 0: none.
    depends_on: int = 0


@dataclass(slots=True)
class TxPublish:
    """A publish held back until tx.commit."""

    exchange: str
    routing_key: str
    mandatory: bool
    header: bytes
    body: bytes
    info: ContentHeaderInfo


@dataclass(slots=True)
class Unacked:
    """A delivery waiting for its ack."""

    queue: Queue
    entry: Entry
    consumer: ChannelConsumer | None


class Channel:
    """A channel of a connection."""

    def __init__(self, connection: Connection, number: int) -> None:
        self.connection = connection
        self.number = number
        self.vhost = connection.vhost
        self.closing = False
        self.flow_active = True
        # content assembly
        self._publish: Publish | None = None
        self._header: bytes = b""
        self._info: ContentHeaderInfo | None = None
        self._body: list[bytes] = []
        self._remaining = 0
        # consumption
        self.consumers: dict[str, ChannelConsumer] = {}
        self.unacked: dict[int, Unacked] = {}
        self.next_tag = 1
        self.consumer_prefetch = 0
        self.global_prefetch = 0
        # confirms and transactions
        self.confirm_mode = False
        self.tx_mode = False
        self.publish_seq = 0
        self.pending: deque[PendingConfirm] = deque()
        self.tx_publishes: list[TxPublish] = []
        self.tx_settles: list[tuple[Literal["ack", "requeue", "reject"], int, bool]] = []

    # -- output --------------------------------------------------------------------------

    def send_method(self, method: MethodFrame) -> None:
        """Queue a method frame for the client."""
        self.connection.send(encode_method(self.number, method))

    # -- content assembly ----------------------------------------------------------------

    @property
    def expecting_content(self) -> bool:
        """Whether a publish is waiting for its header or body frames."""
        return self._publish is not None

    def on_publish(self, publish: Publish) -> None:
        """`basic.publish`: wait for its content."""
        if publish.immediate:
            raise AMQPError(ReplyCode.NOT_IMPLEMENTED, "immediate=true", 60, 40)
        # A peer's status is transient news, not the source site's data: not refused on a
        # DR replica (a 403 would close the link's channel; its deliveries go on there).
        self._refuse_write("publish", (60, 40), durable=not self.peer_status(publish))
        self._publish = publish
        self._info = None

    def peer_status(self, publish: Publish) -> bool:
        """Whether `publish` is a federation link's status for this server's amq.peer
        (seed 002: status is sent to the peer's exchange, through the peering)."""
        return (
            self.connection.origin_stamp is not None
            and publish.exchange == PEER_EXCHANGE
            and not self.confirm_mode
            and not self.tx_mode
        )

    def on_header(self, payload: bytes) -> None:
        """A content header frame."""
        if self._publish is None or self._info is not None:
            raise AMQPError(ReplyCode.UNEXPECTED_FRAME, "content header without basic.publish")
        info = decode_content_header(payload)
        if info.class_id != 60:
            raise AMQPError(ReplyCode.FRAME_ERROR, f"content header for class {info.class_id}")
        if info.body_size > self.connection.max_message_size:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED,
                f"message size {info.body_size} is larger than configured max size "
                f"{self.connection.max_message_size}",
                (60, 40),
            )
        if info.user_id is not None and info.user_id != self.connection.user:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED,
                f"user_id property set to '{info.user_id}' but authenticated user was "
                f"'{self.connection.user}'",
                (60, 40),
            )
        if self.connection.origin_stamp is None and MARK in payload:
            # A client's publish: federation's headers are the links' alone.
            payload = strip_federation(payload)
            info = decode_content_header(payload)
        self._header = payload
        self._info = info
        self._remaining = info.body_size
        self._body = []
        if not info.body_size:
            self._complete()

    def on_body(self, payload: bytes) -> None:
        """A content body frame."""
        if self._info is None:
            raise AMQPError(ReplyCode.UNEXPECTED_FRAME, "content body without content header")
        self._remaining -= len(payload)
        if self._remaining < 0:
            raise AMQPError(ReplyCode.FRAME_ERROR, "content body longer than its header said")
        self._body.append(payload)
        if not self._remaining:
            self._complete()

    def _complete(self) -> None:
        publish, info = self._publish, self._info
        assert publish is not None and info is not None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._publish = None
        self._info = None
        self._body = []
        if self.peer_status(publish):
            # News, never worth the link's channel: a user without write access to
            # amq.peer has it dropped and counted there, not a 403.
            self.connection.ctx.receive_peer_status(
                publish.routing_key, self._header, body, info,
                allowed=self.connection.allows("write", "exchange", PEER_EXCHANGE),
                vhost=self.vhost.name,
            )  # fmt: skip
            return
        self.connection.authorize(
            "write", "exchange", publish.exchange or DEFAULT_EXCHANGE, (60, 40)
        )
        exchange = self.vhost.exchange_for_publish(publish.exchange)
        if self.tx_mode:
            self.tx_publishes.append(
                TxPublish(
                    exchange.name, publish.routing_key, publish.mandatory, self._header, body, info
                )
            )
            return
        if self.connection.origin_stamp is not None:
            # A federation link forwarding its downstream's messages: deduplicated here.
            result = self.connection.ctx.receive_forwarded(
                exchange, publish.routing_key, self._header, body, info, hold=self.confirm_mode
            )
        else:
            result = self.vhost.publish(
                exchange, publish.routing_key, self._header, body, info,
                deduplicate=self.connection.deduplicate, hold=self.confirm_mode,
            )  # fmt: skip
        if not result.routed and publish.mandatory and not result.rejected:
            self._return(exchange.name, publish.routing_key, self._header, body)
        if self.confirm_mode:
            self.publish_seq += 1
            # A queue refused it (reject-publish, the length cap): taken by none, nacked.
            kind: Literal["ack", "nack"] = "nack" if result.rejected else "ack"
            self._add_pending(self.publish_seq, result.batch, kind, result.depends_on)

    def _return(self, exchange: str, routing_key: str, header: bytes, body: bytes) -> None:
        self.connection.send(
            encode_return(self.number, ReplyCode.NO_ROUTE, "NO_ROUTE", exchange, routing_key)
        )
        self.connection.send(encode_content(self.number, header, body, self.connection.frame_max))

    # -- confirms and durability ---------------------------------------------------------

    def _add_pending(
        self, seq: int, batch: int, kind: Literal["ack", "nack", "commit"], depends_on: int = 0
    ) -> None:
        if self.pending:
            batch = max(batch, self.pending[-1].batch)
        if batch == 0 and not self.pending:
            self._emit([PendingConfirm(seq, 0, kind, 0.0)])
            return
        self.pending.append(PendingConfirm(seq, batch, kind, time.perf_counter(), depends_on))
        self.connection.await_durable(self)

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Batches up to `batch` are durable (or failed): answer what waited for them.

        Returns whether the channel still waits for a later batch.
        """
        pending = self.pending
        done: list[PendingConfirm] = []
        if failed:
            # A re-send may wait behind a later batch of this channel: its original's
            # failure is its own (a scan only on a failed write, which is rare).
            for item in pending:
                if item.depends_on and item.depends_on <= batch and item.kind == "ack":
                    item.kind = "nack"
        while pending and pending[0].batch <= batch:
            item = pending.popleft()
            if failed and item.kind == "ack":
                item.kind = "nack"
            elif failed and item.kind == "commit":
                item.kind = "commit-failed"
            done.append(item)
        if done:
            self._emit(done)
        return bool(pending)

    def _emit(self, done: list[PendingConfirm]) -> None:
        """Send confirms, collapsing runs of acks into one `multiple` ack."""
        if self.closing:
            return
        now = time.perf_counter()
        send = self.connection.send
        run_end = 0
        run_len = 0
        run_started = 0.0  # the oldest publish of the run: one latency per confirm frame
        for item in done:
            if item.kind == "ack":
                run_end = item.seq
                if not run_len:
                    run_started = item.started
                run_len += 1
                continue
            if run_len:
                send(encode_basic_ack(self.number, run_end, run_len > 1))
                self._count_acks(run_len, run_started, now)
                run_len = 0
            if item.kind == "nack":
                send(encode_basic_nack(self.number, item.seq, False))
                metrics.CONFIRMS_NACK.inc()
            elif item.kind == "commit":
                self.send_method(commands.Tx.CommitOk())
            else:
                # Never tx.commit-ok for a transaction that is not on disk: the client
                # must see that the commit failed (and re-send, perhaps twice).
                metrics.CONFIRMS_COMMIT_FAILED.inc()
                self.connection.channel_error(
                    self.number,
                    channel_error(
                        ReplyCode.INTERNAL_ERROR,
                        "tx.commit failed: the journal write failed (see the broker log); "
                        "the transaction is not durable, publish it again",
                        (90, 20),
                    ),
                )
                return
        if run_len:
            send(encode_basic_ack(self.number, run_end, run_len > 1))
            self._count_acks(run_len, run_started, now)

    @staticmethod
    def _count_acks(run_len: int, started: float, now: float) -> None:
        metrics.CONFIRMS_ACK.value += run_len
        if started:
            metrics.CONFIRM_LATENCY.observe(now - started)

    # -- consumption ---------------------------------------------------------------------

    def deliver(self, consumer: ChannelConsumer, queue: Queue, entry: Entry) -> None:
        """Send one delivery; track it until acked unless the consumer is no-ack."""
        tag = self.next_tag
        self.next_tag += 1
        message = entry.message
        conn = self.connection
        conn.send(
            encode_deliver(
                self.number,
                consumer.tag_bytes,
                tag,
                entry.redelivered,
                message.exchange.encode(),
                message.routing_key.encode(),
            )
            + encode_content(
                self.number,
                message.header
                if conn.origin_stamp is None
                else stamp_origin(message.header, conn.origin_stamp, message.mid),
                message.body,
                conn.frame_max,
            )
        )
        metrics.DELIVERED.value += 1
        if conn.marks is not None and not consumer.no_ack:
            conn.marks.delivered(queue, entry, self.number)  # a federation link's marks
        if consumer.no_ack:
            self.vhost.settle(queue, [entry])
            return
        queue.delivered[message.mid] = entry
        consumer.unacked += 1
        self.unacked[tag] = Unacked(queue, entry, consumer)

    def server_cancel(self, consumer: ChannelConsumer) -> None:
        """The broker cancelled a consumer (its queue was deleted)."""
        self.consumers.pop(consumer.tag, None)
        if self.connection.capabilities.get("consumer_cancel_notify") and not self.closing:
            self.send_method(commands.Basic.Cancel(consumer_tag=consumer.tag, nowait=True))

    def _take(self, tag: int, multiple: bool, method: tuple[int, int]) -> list[Unacked]:
        if multiple:
            tags = [t for t in self.unacked if t <= tag] if tag else list(self.unacked)
            return [self.unacked.pop(t) for t in tags]
        item = self.unacked.pop(tag, None)
        if item is None:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}", method
            )
        return [item]

    def _settle(
        self,
        action: Literal["ack", "requeue", "reject"],
        items: list[Unacked],
        ops: list[JournalOp] | None = None,
    ) -> None:
        by_queue: dict[Queue, list[Entry]] = {}
        for item in items:
            by_queue.setdefault(item.queue, []).append(item.entry)
            if item.consumer is not None:
                item.consumer.unacked -= 1
        vhost = self.vhost
        for queue, entries in by_queue.items():
            if action == "ack":
                vhost.settle(queue, entries, ops)
                metrics.ACKED.value += len(entries)
            elif action == "requeue":
                vhost.requeue(queue, entries)
                metrics.REDELIVERED.inc(len(entries))
            else:
                vhost.reject(queue, entries)
        self._redispatch()

    def _redispatch(self) -> None:
        now = self.vhost.clock.time()
        for queue in {c.queue for c in self.consumers.values()}:
            queue.dispatch(now)

    def on_ack(self, ack: Ack) -> None:
        """`basic.ack` from a consumer."""
        if self.tx_mode:
            self._check_tags(ack.delivery_tag, ack.multiple, BASIC_ACK)
            self.tx_settles.append(("ack", ack.delivery_tag, ack.multiple))
            return
        self._settle("ack", self._take(ack.delivery_tag, ack.multiple, BASIC_ACK))

    def _check_tags(self, tag: int, multiple: bool, method: tuple[int, int]) -> None:
        if not multiple and tag not in self.unacked:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}", method
            )

    def on_reject(self, tag: int, multiple: bool, requeue: bool, method: tuple[int, int]) -> None:
        """`basic.nack` / `basic.reject`."""
        action: Literal["requeue", "reject"] = "requeue" if requeue else "reject"
        if self.tx_mode:
            self._check_tags(tag, multiple, method)
            self.tx_settles.append((action, tag, multiple))
            return
        self._settle(action, self._take(tag, multiple, method))

    def release(self) -> None:
        """The channel closes: cancel its consumers, requeue what it had not acked."""
        self.closing = True
        vhost = self.vhost
        for consumer in list(self.consumers.values()):
            consumer.queue.remove_consumer(consumer)
        queues = {c.queue for c in self.consumers.values()}
        self.consumers.clear()
        if self.unacked:
            items = list(self.unacked.values())
            self.unacked.clear()
            self._settle("requeue", items)
        for queue in queues:
            vhost.consumer_removed(queue)
        self.pending.clear()
        self.tx_publishes.clear()
        self.tx_settles.clear()

    # -- methods -------------------------------------------------------------------------

    def handle(self, method: MethodFrame) -> None:
        """Handle any other method on this channel."""
        handler: Callable[[Channel, Any], None] | None = _HANDLERS.get(type(method))
        if handler is None:
            raise AMQPError(
                ReplyCode.COMMAND_INVALID, f"unexpected method {method.name} on a channel"
            )
        if handler in _TOPOLOGY:
            # Its change is staged for the loop turn's group commit; its reply and
            # what follows on this channel wait for it (Connection.hold).
            with self.vhost.staging(self._hold):
                handler(self, method)
        else:
            handler(self, method)

    def _hold(self, change: StagedChange) -> None:
        self.connection.hold(self, change)

    def _refuse_write(self, what: str, method: tuple[int, int], durable: bool = True) -> None:
        """On a DR replica, a publish or a change to mirrored (durable) topology is
        refused (403): the source site owns them, and an id made here could collide
        with one the source makes."""
        why = self.connection.write_refusal() if durable else None
        if why is not None:
            raise channel_error(ReplyCode.ACCESS_REFUSED, f"{what} refused: {why}", method)

    def _durable_queue(self, name: str) -> bool:
        """Whether `name` is a mirrored queue (the mirror's own, like its DLQ, are not)."""
        queue = self.vhost.queues.get(name)
        return queue is not None and queue.durable and not is_internal(name)

    def _exchange_declare(self, m: commands.Exchange.Declare) -> None:
        if not m.passive:
            self.connection.authorize("configure", "exchange", m.exchange, (40, 10))
        if not m.passive and m.exchange not in self.vhost.exchanges:
            self._refuse_write(f"exchange.declare {m.exchange!r}", (40, 10))
        self.vhost.declare_exchange(
            m.exchange,
            m.exchange_type,
            passive=m.passive,
            durable=m.durable,
            auto_delete=m.auto_delete,
            internal=m.internal,
            arguments=dict(m.arguments or {}),
        )
        if not m.nowait:
            self.send_method(commands.Exchange.DeclareOk())

    def _exchange_delete(self, m: commands.Exchange.Delete) -> None:
        self.connection.authorize("configure", "exchange", m.exchange, (40, 20))
        self._refuse_write(f"exchange.delete {m.exchange!r}", (40, 20))
        self.vhost.delete_exchange(m.exchange, if_unused=m.if_unused)
        if not m.nowait:
            self.send_method(commands.Exchange.DeleteOk())

    def _exchange_bind(self, m: MethodFrame) -> None:
        raise AMQPError(
            ReplyCode.NOT_IMPLEMENTED, "exchange-to-exchange bindings are not supported", 40, 30
        )

    def _queue_declare(self, m: commands.Queue.Declare) -> None:
        if not m.passive:
            name = m.queue or SERVER_NAMED_QUEUE
            self.connection.authorize("configure", "queue", name, (50, 10))
            dlx = (m.arguments or {}).get("x-dead-letter-exchange")
            if isinstance(dlx, str):
                # Dead-lettering publishes the queue's messages to that exchange.
                self.connection.authorize("write", "exchange", dlx or DEFAULT_EXCHANGE, (50, 10))
                self.connection.authorize("read", "queue", name, (50, 10))
        if not m.passive and m.queue not in self.vhost.queues:
            self._refuse_write(f"queue.declare {m.queue!r}", (50, 10), bool(m.durable))
        queue = self.vhost.declare_queue(
            m.queue,
            passive=m.passive,
            durable=m.durable,
            exclusive=m.exclusive,
            auto_delete=m.auto_delete,
            arguments=dict(m.arguments or {}),
            owner=self.connection,
        )
        if not m.nowait:
            self.connection.send(
                encode_declare_ok(
                    self.number, queue.name, queue.message_count, len(queue.consumers)
                )
            )

    def _queue_bind(self, m: commands.Queue.Bind) -> None:
        self._authorize_binding(m.queue, m.exchange, (50, 20))
        self._refuse_write(f"queue.bind {m.queue!r}", (50, 20), self._durable_queue(m.queue))
        self.vhost.bind(
            m.queue, m.exchange, m.routing_key, dict(m.arguments or {}), self.connection
        )
        if not m.nowait:
            self.send_method(commands.Queue.BindOk())

    def _queue_unbind(self, m: commands.Queue.Unbind) -> None:
        self._authorize_binding(m.queue, m.exchange, (50, 50))
        self._refuse_write(f"queue.unbind {m.queue!r}", (50, 50), self._durable_queue(m.queue))
        self.vhost.bind(
            m.queue,
            m.exchange,
            m.routing_key,
            dict(m.arguments or {}),
            self.connection,
            unbind=True,
        )
        self.send_method(commands.Queue.UnbindOk())

    def _authorize_binding(self, queue: str, exchange: str, method: tuple[int, int]) -> None:
        # RabbitMQ's rule: a binding writes to the queue and reads from the exchange.
        self.connection.authorize("write", "queue", queue, method)
        self.connection.authorize("read", "exchange", exchange or DEFAULT_EXCHANGE, method)

    def _queue_purge(self, m: commands.Queue.Purge) -> None:
        self.connection.authorize("read", "queue", m.queue, (50, 30))
        self._refuse_write(f"queue.purge {m.queue!r}", (50, 30), self._durable_queue(m.queue))
        count = self.vhost.purge_queue(m.queue, self.connection)
        if not m.nowait:
            self.send_method(commands.Queue.PurgeOk(message_count=count))

    def _queue_delete(self, m: commands.Queue.Delete) -> None:
        self.connection.authorize("configure", "queue", m.queue, (50, 40))
        self._refuse_write(f"queue.delete {m.queue!r}", (50, 40), self._durable_queue(m.queue))
        count = self.vhost.delete_queue(
            m.queue, if_unused=m.if_unused, if_empty=m.if_empty, owner=self.connection
        )
        if not m.nowait:
            self.send_method(commands.Queue.DeleteOk(message_count=count))

    def _basic_qos(self, m: commands.Basic.Qos) -> None:
        if m.prefetch_size:
            raise AMQPError(ReplyCode.NOT_IMPLEMENTED, "prefetch_size!=0", 60, 10)
        if m.global_:
            self.global_prefetch = m.prefetch_count
        else:
            self.consumer_prefetch = m.prefetch_count
        self.send_method(commands.Basic.QosOk())
        self._redispatch()

    def _basic_consume(self, m: commands.Basic.Consume) -> None:
        self.connection.authorize("read", "queue", m.queue, (60, 20))
        queue = self.vhost.queue(m.queue, self.connection, (60, 20))
        tag = m.consumer_tag or "amq.ctag-" + secrets.token_urlsafe(16)
        if tag in self.consumers:
            raise AMQPError(ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'", 60, 20)
        consumer = ChannelConsumer(self, queue, tag, m.no_ack, m.exclusive, self.consumer_prefetch)
        queue.add_consumer(consumer)
        self.consumers[tag] = consumer
        self.vhost.touch(queue)
        if not m.nowait:
            self.send_method(commands.Basic.ConsumeOk(consumer_tag=tag))
        queue.dispatch(self.vhost.clock.time())

    def _basic_cancel(self, m: commands.Basic.Cancel) -> None:
        consumer = self.consumers.pop(m.consumer_tag or "", None)
        if consumer is not None:
            consumer.queue.remove_consumer(consumer)
            self.vhost.consumer_removed(consumer.queue)
        if not m.nowait:
            self.send_method(commands.Basic.CancelOk(consumer_tag=m.consumer_tag))

    def _basic_get(self, m: commands.Basic.Get) -> None:
        self.connection.authorize("read", "queue", m.queue, (60, 70))
        queue = self.vhost.queue(m.queue, self.connection, (60, 70))
        self.vhost.touch(queue)
        entry = queue.pop(self.vhost.clock.time())
        if entry is None:
            self.send_method(commands.Basic.GetEmpty())
            return
        tag = self.next_tag
        self.next_tag += 1
        message = entry.message
        conn = self.connection
        conn.send(
            encode_get_ok(
                self.number,
                tag,
                entry.redelivered,
                message.exchange,
                message.routing_key,
                queue.message_count,
            )
            + encode_content(self.number, message.header, message.body, conn.frame_max)
        )
        metrics.DELIVERED.value += 1
        if m.no_ack:
            self.vhost.settle(queue, [entry])
        else:
            queue.delivered[message.mid] = entry
            self.unacked[tag] = Unacked(queue, entry, None)

    def _basic_reject(self, m: commands.Basic.Reject) -> None:
        self.on_reject(m.delivery_tag or 0, False, m.requeue, BASIC_REJECT)

    def _basic_nack(self, m: commands.Basic.Nack) -> None:
        self.on_reject(m.delivery_tag, m.multiple, m.requeue, BASIC_NACK)

    def _basic_ack(self, m: commands.Basic.Ack) -> None:
        self.on_ack(Ack(m.delivery_tag, m.multiple))

    def _basic_recover(self, m: commands.Basic.Recover) -> None:
        if not m.requeue:
            raise AMQPError(ReplyCode.NOT_IMPLEMENTED, "requeue=false", 60, 110)
        items = list(self.unacked.values())
        self.unacked.clear()
        self._settle("requeue", items)
        self.send_method(commands.Basic.RecoverOk())

    def _confirm_select(self, m: commands.Confirm.Select) -> None:
        if self.tx_mode:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, "cannot switch from tx to confirm mode", (85, 10)
            )
        self.confirm_mode = True
        if not m.nowait:
            self.send_method(commands.Confirm.SelectOk())

    def _tx_select(self, m: commands.Tx.Select) -> None:
        if self.confirm_mode:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, "cannot switch from confirm to tx mode", (90, 10)
            )
        self.tx_mode = True
        self.send_method(commands.Tx.SelectOk())

    def _tx_commit(self, m: commands.Tx.Commit) -> None:
        if not self.tx_mode:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, "channel is not transactional", (90, 20)
            )
        ops: list[JournalOp] = []
        keys: list[str] = []
        published: list[tuple[Queue, Entry]] = []
        acked: list[tuple[Queue, Entry]] = []
        vhost = self.vhost
        # Before anything changes: a commit takes every publish or none (the channel's
        # close then requeues what the transaction acknowledged, as a rollback would), so
        # no publish of a commit-ok is dropped by a full queue.
        refusal = vhost.tx_refusal(
            (vhost.exchange_for_publish(p.exchange), p.routing_key, p.header, len(p.body))
            for p in self.tx_publishes
        )
        if refusal is not None:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, f"tx.commit refused: {refusal}", (90, 20)
            )
        for p in self.tx_publishes:
            exchange = vhost.exchange_for_publish(p.exchange)
            result = vhost.publish(
                exchange, p.routing_key, p.header, p.body, p.info, ops,
                deduplicate=self.connection.deduplicate, admission="committed",
            )  # fmt: skip
            if result.dedup_key is not None:
                keys.append(result.dedup_key)
            if result.held:
                published += result.held
            if not result.routed and p.mandatory:
                self._return(p.exchange, p.routing_key, p.header, p.body)
        for action, tag, multiple in self.tx_settles:
            items = self._take(tag, multiple, BASIC_ACK)
            if action == "ack":
                acked += [(item.queue, item.entry) for item in items]
            self._settle(action, items, ops if action == "ack" else None)
        self.tx_publishes.clear()
        self.tx_settles.clear()
        # One journal record for the whole transaction: recovered entirely or not at all,
        # and seen by consumers entirely (once durable) or not at all (visibility.py).
        batch = vhost.committer.add(ops) if ops else vhost.committer.confirm_point()
        vhost.visibility.hold_transaction(batch, published, acked)
        if keys:
            vhost.remember_when_durable(keys, batch)
        self._add_pending(0, batch, "commit")

    def _tx_rollback(self, m: commands.Tx.Rollback) -> None:
        if not self.tx_mode:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, "channel is not transactional", (90, 30)
            )
        self.tx_publishes.clear()
        self.tx_settles.clear()
        self.send_method(commands.Tx.RollbackOk())

    def _channel_flow(self, m: commands.Channel.Flow) -> None:
        self.flow_active = bool(m.active)
        self.send_method(commands.Channel.FlowOk(active=m.active))
        if m.active:
            self._redispatch()


_HANDLERS: dict[type[MethodFrame], Callable[[Channel, Any], None]] = {
    commands.Exchange.Declare: Channel._exchange_declare,
    commands.Exchange.Delete: Channel._exchange_delete,
    commands.Exchange.Bind: Channel._exchange_bind,
    commands.Exchange.Unbind: Channel._exchange_bind,
    commands.Queue.Declare: Channel._queue_declare,
    commands.Queue.Bind: Channel._queue_bind,
    commands.Queue.Unbind: Channel._queue_unbind,
    commands.Queue.Purge: Channel._queue_purge,
    commands.Queue.Delete: Channel._queue_delete,
    commands.Basic.Qos: Channel._basic_qos,
    commands.Basic.Consume: Channel._basic_consume,
    commands.Basic.Cancel: Channel._basic_cancel,
    commands.Basic.Get: Channel._basic_get,
    commands.Basic.Ack: Channel._basic_ack,
    commands.Basic.Reject: Channel._basic_reject,
    commands.Basic.Nack: Channel._basic_nack,
    commands.Basic.Recover: Channel._basic_recover,
    commands.Confirm.Select: Channel._confirm_select,
    commands.Tx.Select: Channel._tx_select,
    commands.Tx.Commit: Channel._tx_commit,
    commands.Tx.Rollback: Channel._tx_rollback,
    commands.Channel.Flow: Channel._channel_flow,
}

# The methods whose durable change is staged for the group commit (vhost.staging);
# queue.delete is saved at once (its purge cannot be undone), after what was staged.
_TOPOLOGY = {
    Channel._exchange_declare,
    Channel._exchange_delete,
    Channel._queue_declare,
    Channel._queue_bind,
    Channel._queue_unbind,
}
