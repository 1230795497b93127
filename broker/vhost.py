"""Virtual hosts: exchanges, queues and bindings, and what happens to a message in them.

A broker has the vhost `/` (the `VirtualHost` the server holds: the root) and any others
the users file declares (`add_vhost`), each with its own exchanges (its own `amq.*`),
queues and bindings: the same name in two vhosts is two objects. They share the
broker's journal, its message ids and queue incarnation ids (`qid`, unique across
vhosts, so journal records of messages need no vhost), the dedup window (keys scoped by
vhost) and the clock. The root answers for all of them where the broker acts as a whole:
recovery, the journal's whole topology, replication to the passive.

Pure broker logic with no I/O of its own: durability goes through a `Committer`
(journal group commit, later replication too) and time through a `Clock`, both
passed in, so tests and the asyncio server drive the same code.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from twinmq.broker import metrics
from twinmq.broker.codec import (
    ContentHeaderInfo,
    decode_content_header,
    decode_headers,
    header_message_id,
)
from twinmq.broker.deadletter import dead_letter_header, is_cycle
from twinmq.broker.dedup import DedupWindow, scoped_dedup_key
from twinmq.broker.definitions import (
    DEFAULT_VHOST,
    BindingDef,
    Definitions,
    DefinitionsDelta,
    ExchangeDef,
    ExchangeType,
    QueueDef,
)
from twinmq.broker.errors import AMQPError, ReplyCode, channel_error
from twinmq.broker.fieldtable import to_python
from twinmq.broker.journal import JournalError, JournalOp, Recovered, Settle, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror.events import is_internal
from twinmq.broker.queue import NO_CAP, DropReason, LengthCap, Queue
from twinmq.broker.routing import EXCHANGE_TYPES, Exchange, make_exchange
from twinmq.broker.visibility import UNCOMMITTED, Visibility

if TYPE_CHECKING:
    from twinmq.broker.commit import Waiter

log = logging.getLogger(__name__)

BUILTIN_EXCHANGES: tuple[tuple[str, ExchangeType], ...] = (
    ("", "direct"),
    ("amq.direct", "direct"),
    ("amq.fanout", "fanout"),
    ("amq.topic", "topic"),
    ("amq.headers", "headers"),
    ("amq.match", "headers"),
    # Peer status messages of federation (broker/federation/peer.py).
    ("amq.peer", "fanout"),
    # State replication: this server's definitions for subscribers (broker/federation/state.py).
    ("amq.twinmq.state", "fanout"),
)

# (class id, method id) of the methods whose failures name them in channel.close.
EXCHANGE_DECLARE = (40, 10)
EXCHANGE_DELETE = (40, 20)
QUEUE_DECLARE = (50, 10)
QUEUE_BIND = (50, 20)
QUEUE_PURGE = (50, 30)
QUEUE_DELETE = (50, 40)
QUEUE_UNBIND = (50, 50)
BASIC_PUBLISH = (60, 40)


class Cancellable(Protocol):
    """A scheduled callback that can be cancelled."""

    def cancel(self) -> None:
        """Cancel the callback."""


class Clock(Protocol):
    """Time and timers, supplied by the event loop."""

    def time(self) -> float:
        """Wall-clock time in seconds (TTL deadlines survive restarts, so not monotonic)."""
        ...

    def call_later(self, delay: float, callback: Callable[[], None]) -> Cancellable:
        """Run `callback` after `delay` seconds."""
        ...


class Committer(Protocol):
    """Makes journal operations durable in batches (group commit)."""

    def add(self, ops: Iterable[JournalOp]) -> int:
        """Queue ops for the next batch and return that batch's number."""
        ...

    def confirm_point(self) -> int:
        """The batch a confirm issued now must wait for; 0 when nothing is outstanding."""
        ...

    def save_definitions(self, definitions: Definitions) -> None:
        """Durably replace the stored topology."""
        ...

    def save_delta(self, delta: DefinitionsDelta, current: Callable[[], Definitions]) -> None:
        """Durably record one change of the stored topology (`current`: the whole of it
        after the change, for whoever needs it whole)."""
        ...

    def stage_delta(
        self,
        delta: DefinitionsDelta,
        current: Callable[[], Definitions],
        done: Callable[[JournalError | None], None],
    ) -> None:
        """Record a change with the others of this loop turn (one write, one fsync);
        `done` hears the outcome: None once durable, the error if the write failed."""
        ...

    def drop_queue(self, qid: int) -> None:
        """A durable queue was deleted: its journaled messages are garbage."""
        ...

    def await_durable(self, waiter: Waiter) -> None:
        """Tell `waiter` as batches complete or fail."""
        ...


class StagedChange:
    """A client's topology change, made in memory, waiting for its group commit.

    The channel holds its reply, and everything it sends after it, until `resolve`
    (connection.py `hold`): an ok never goes before its change is durable, and a
    later reply on the channel never overtakes it.
    """

    __slots__ = ("done", "error", "on_done")

    def __init__(self) -> None:
        self.done = False
        self.error: AMQPError | None = None  # what the method gets if the write failed
        self.on_done: Callable[[], None] | None = None

    def resolve(self, error: AMQPError | None) -> None:
        """The change is durable (None) or refused and undone (the channel's error)."""
        self.done = True
        self.error = error
        if self.on_done is not None:
            self.on_done()


@dataclass(frozen=True, slots=True)
class Touched:
    """What one change of the definitions touched, by name, so that state replication
    follows the definitions one change at a time (O(change), not O(state)).

    An exchange or queue named here may have appeared, gone, been replaced or changed;
    a binding named here may have been added or removed. `everything`: not said (a
    passive's replicated topology, an undone change): compare the whole state."""

    exchanges: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    bindings: tuple[BindingDef, ...] = ()
    everything: bool = False


EVERYTHING = Touched(everything=True)


Admission = Literal["publish", "link", "committed", "news"]
"""How a publish meets the queues' refusing limits (a full `x-overflow: reject-publish`
queue, the broker's length cap): "publish", a client's, all or nothing (one queue refusing,
it goes to none and is nacked, so no copy of it outlives the nack); "link", a federation
link's delivery, each queue's own rule but not the cap (refused, it would be acknowledged
upstream and lost); "committed", a transaction's publish, checked with the whole
transaction before its commit (`tx_refusal`), then taken by every queue; "news", the
broker's own status messages (`amq.peer`, `amq.twinmq.state`), each queue's rule and the
cap, queue by queue (no publisher to nack: one full queue must not keep them from the
others)."""


@dataclass(slots=True)
class PublishResult:
    """Where a publish went: the number of queues, whether a limit refused it, its batch."""

    routed: int
    rejected: bool
    batch: int
    # In a transaction: the dedup key to remember once the commit is durable ...
    dedup_key: str | None = None
    # ... and the entries it put in queues, invisible until the commit's batch completes.
    held: list[tuple[Queue, Entry]] | None = None
    # A re-send of a message still in flight: the original's batch, whose failure must
    # fail this confirm too, even when it is merged behind a later batch of the channel.
    depends_on: int = 0


class _Ids:
    """The ids the vhosts of one broker share (one journal): message ids and queue
    incarnation ids."""

    __slots__ = ("mid", "qid")

    def __init__(self) -> None:
        self.mid = 1
        self.qid = 1


class VirtualHost:
    """One virtual host; the root (`/`, `root is self`) also holds the others (`vhosts`)."""

    def __init__(
        self,
        committer: Committer,
        clock: Clock,
        recovered: Recovered | None,
        *,
        replica: bool = False,
        dedup: DedupWindow | None = None,
        max_queues: int = 0,
        queue_cap: LengthCap = NO_CAP,
        name: str = DEFAULT_VHOST,
        root: VirtualHost | None = None,
    ) -> None:
        self.name = name
        self.root: VirtualHost = self if root is None else root
        # Every vhost of the broker by name, the root's dict (shared by all of them).
        self.vhosts: dict[str, VirtualHost] = {name: self} if root is None else root.vhosts
        self._ids: _Ids = _Ids() if root is None else root._ids
        # The root's: told each vhost made after it (federation serves every vhost).
        self.vhost_listeners: list[Callable[[VirtualHost], None]] = []
        # A vhost removed from the users file: new connections refused, content kept.
        self.retired = False
        self.committer = committer
        self.max_queues = max_queues  # clients' declares only (0: no limit)
        self.queue_cap = queue_cap  # every client queue's; never the broker's own
        self.cap_logged_at = float("-inf")  # the root's: its last refusal logged
        self.dlx_skip_logged_at = float("-inf")  # the root's: a refused copy not dead-lettered
        self.clock = clock
        # A passive broker's state changes only by replication: no timers of its own.
        self.replica = replica
        # Replication: told each saved topology change, as a delta when the passive
        # understands them (`on_topology_delta`), else whole (`on_topology_change`).
        self.on_topology_change: Callable[[Definitions], None] | None = None
        self.on_topology_delta: Callable[[DefinitionsDelta], None] | None = None
        # `queue.declare` with an empty name: this, then a random token; with --server-id
        # `amq.gen-<server id>.` so the name is unique across a federation (a reply-to).
        self.server_named_prefix = "amq.gen-"
        # Federation (docs/federation.md): the link queue(s) for a routing key on the
        # default exchange that names another server's temporary queue.
        self.reply_router: Callable[[str], list[str]] | None = None
        # Federation forwarding (docs/federation.md): exchange name -> its outbox queue.
        self.forwarding: dict[str, Queue] = {}
        # Told the exchange's name whenever its bindings change (federation propagates them).
        self.binding_listeners: list[Callable[[str], None]] = []
        # Told whenever an exchange, a queue or a binding appears or goes (state replication).
        self.definition_listeners: list[Callable[[], None]] = []
        # Told what each such change touched, undone changes too (state replication).
        self.state_listeners: list[Callable[[Touched], None]] = []
        # Told each queue a client declares (federation binds temporary queues: global keys).
        self.queue_listeners: list[Callable[[Queue], None]] = []
        # Federation global keys: a client's publish on exchange X -> its header with
        # `reply-to` made global (or the header unchanged).
        self.reply_to_rewriters: dict[str, Callable[[bytes], bytes]] = {}
        self._by_qid: dict[int, Queue] | None = None  # the root's: every vhost's queues
        self._other_qids: frozenset[int] = frozenset()  # built with `_by_qid`
        # While a channel handles a method (`staging`): where its staged changes go.
        self._stage: Callable[[StagedChange], None] | None = None
        self.dedup = dedup if dedup is not None else DedupWindow(0)
        self.visibility = Visibility(committer.await_durable, clock.time, self.requeue)
        self.exchanges: dict[str, Exchange] = {}
        self.queues: dict[str, Queue] = {}
        self._timers: dict[str, Cancellable] = {}
        self._expiry_timers: dict[str, Cancellable] = {}
        self._unordered: set[Queue] = set()  # replicated out of replication ID order
        for name, etype in BUILTIN_EXCHANGES:
            self.exchanges[name] = make_exchange(
                ExchangeDef(name=name, type=etype, vhost=self.name)
            )
        if recovered is not None:
            self._recover(recovered)
            if root is None:
                for other in sorted(recovered.definitions.vhost_names() - {self.name}):
                    self.add_vhost(other, recovered)

    @property
    def next_mid(self) -> int:
        """The next message id (the broker's, shared by its vhosts)."""
        return self._ids.mid

    @next_mid.setter
    def next_mid(self, value: int) -> None:
        self._ids.mid = value

    @property
    def next_qid(self) -> int:
        """The next queue incarnation id (the broker's, shared by its vhosts)."""
        return self._ids.qid

    @next_qid.setter
    def next_qid(self, value: int) -> None:
        self._ids.qid = value

    # -- vhosts -----------------------------------------------------------------------------

    def add_vhost(self, name: str, recovered: Recovered | None = None) -> VirtualHost:
        """The vhost `name`, made (empty, or from `recovered`) if the broker has none yet."""
        root = self.root
        vhost = root.vhosts.get(name)
        if vhost is None:
            vhost = VirtualHost(
                root.committer, root.clock, recovered, replica=root.replica, dedup=root.dedup,
                max_queues=root.max_queues, queue_cap=root.queue_cap, name=name, root=root,
            )  # fmt: skip
            vhost.server_named_prefix = root.server_named_prefix
            root.vhosts[name] = vhost
            root._by_qid = None
            log.info("vhost %r: %d queues", name, len(vhost.queues))
            for listener in root.vhost_listeners:
                listener(vhost)
        return vhost

    def delete_content(self) -> tuple[int, int, int]:
        """Delete every queue (with its messages) and exchange of this vhost other than `/`,
        and the vhost itself: the admin API's `DELETE /vhosts/{name}` for a vhost retired
        from the users file. Returns (queues, exchanges, ready messages) deleted."""
        assert self.root is not self, "the vhost '/' is never deleted"
        queues = list(self.queues.values())
        messages = sum(self.remove_queue(queue) for queue in queues)
        builtin = {name for name, _ in BUILTIN_EXCHANGES}
        exchanges = [e for e in self.exchanges.values() if e.name not in builtin]
        for exchange in exchanges:
            del self.exchanges[exchange.name]
        durable = [e.name for e in exchanges if e.definition.durable]
        if durable:
            self._save(self._delta(del_exchanges=durable))
        # The vhost itself, last: streamed to the passive, which drops it too (a disk
        # that refuses the record raises here, and the vhost, empty, stays until a retry).
        self._save(self._delta(drop_vhost=True))
        self._drop()
        log.warning(
            "vhost %r deleted: %d queues with %d ready messages, %d exchanges",
            self.name, len(queues), messages, len(exchanges),
        )  # fmt: skip
        return len(queues), len(exchanges), messages

    def _drop(self) -> None:
        """Take this (emptied) vhost out of the broker."""
        for timer in [*self._timers.values(), *self._expiry_timers.values()]:
            timer.cancel()
        self.root.vhosts.pop(self.name, None)
        self.root._by_qid = None
        self._queues_changed()

    def all_queues(self) -> list[Queue]:
        """The queues of every vhost of the broker."""
        return [q for v in self.root.vhosts.values() for q in v.queues.values()]

    def all_definitions(self) -> Definitions:
        """The durable topology of every vhost (the journal's, the passive's)."""
        parts = [v.definitions() for v in self.root.vhosts.values()]
        return Definitions(
            exchanges=[e for d in parts for e in d.exchanges],
            queues=[q for d in parts for q in d.queues],
            bindings=[b for d in parts for b in d.bindings],
            next_qid=self.next_qid,
        )

    def _delta(self, **parts: Any) -> DefinitionsDelta:
        return DefinitionsDelta(vhost=self.name, **parts)

    def _queues_changed(self) -> None:
        metrics.QUEUES.set(sum(len(v.queues) for v in self.root.vhosts.values()))

    # -- recovery and persistence ---------------------------------------------------------

    def _recover(self, recovered: Recovered) -> None:
        defs = recovered.definitions.of_vhost(self.name)
        replica_mode = self.replica
        if self.root is self:
            self.next_qid = max(defs.next_qid, 1)
            self.next_mid = max(recovered.next_mid, 1)
        for edef in defs.exchanges:
            if edef.name not in self.exchanges:
                self.exchanges[edef.name] = make_exchange(edef)
        now = self.clock.time()
        for qdef in defs.queues:
            # Recovery always completes: arguments refused by today's rules are ignored.
            queue = Queue(qdef, None, self._dropped, self.visibility, lenient=True)
            self.queues[qdef.name] = queue
            # The default exchange's bindings are implicit (not in the definitions file).
            self.exchanges[""].bind(self._default_binding(qdef.name))
            opaque: list[int] = []
            for stored in recovered.messages.get(qdef.qid, ()):
                message_id, why = _recovered_header(stored.header)
                if why is not None:
                    opaque.append(stored.mid)
                # The expiration is already folded into `expires_at`.
                message = Message(
                    stored.mid,
                    stored.exchange,
                    stored.routing_key,
                    stored.header,
                    stored.body,
                    True,
                    None,
                    message_id,
                )
                if message.message_id is not None:
                    self.dedup.add(
                        scoped_dedup_key(
                            self.name, stored.exchange, stored.routing_key, message.message_id
                        )
                    )
                # A message recovered from disk may have been delivered before the crash.
                entry = Entry(message, stored.expires_at, True, redelivered=True)
                if not _names_fit(message):
                    # basic.deliver could not carry it: kept, never sent.
                    queue.hold_aside(entry, "recovery", "exchange or routing key over 255 bytes")
                    continue
                queue.entries.append(entry)
                queue.bytes += len(stored.body)
            if opaque:
                metrics.QUARANTINED.labels("recovery").inc(len(opaque))
                log.error(
                    "queue %r: %d recovered messages have content headers this broker would "
                    "refuse at publish (first: message %d); recovered as opaque bytes",
                    qdef.name,
                    len(opaque),
                    opaque[0],
                )
            # Journal order is not publish order where a catch-up's chunks of older
            # messages were journaled after live ones (a passive, or one promoted since).
            queue.sort_by_mid()
        for bdef in defs.bindings:
            exchange = self.exchanges.get(bdef.exchange)
            if exchange is not None and bdef.queue in self.queues:
                exchange.bind(bdef)
        if not replica_mode:
            # Only now that every queue and binding is back: a message that expired while
            # the broker was down is dead-lettered, not lost to a half-built topology.
            for queue in list(self.queues.values()):
                queue.expire(now)
                self._schedule_expiry(queue)
                self._touch(queue)

    def definitions(self) -> Definitions:
        """The durable topology as it stands."""
        builtin = {name for name, _ in BUILTIN_EXCHANGES}
        return Definitions(
            exchanges=[
                e.definition
                for e in self.exchanges.values()
                if e.definition.durable and e.name not in builtin
            ],
            queues=[q.definition for q in self.queues.values() if q.durable],
            bindings=[
                b
                for e in self.exchanges.values()
                if e.definition.durable and e.name != ""
                for b in e.bindings.values()
                if self.queues[b.queue].durable
            ],
            next_qid=self.next_qid,
        )

    def _default_binding(self, queue: str) -> BindingDef:
        # Every queue is bound to its vhost's default exchange under its own name.
        return BindingDef(exchange="", queue=queue, routing_key=queue, vhost=self.name)

    def _save(self, delta: DefinitionsDelta) -> None:
        """Durably record a topology change the caller already made in memory."""
        self.root._by_qid = None
        self.committer.save_delta(delta, self.all_definitions)
        self._saved(delta)

    def _saved(self, delta: DefinitionsDelta) -> None:
        """A change is durable here: stream it to the passive (after, never before)."""
        root = self.root
        if root.on_topology_delta is not None:
            root.on_topology_delta(delta)
        elif root.on_topology_change is not None:
            root.on_topology_change(root.all_definitions())

    @contextlib.contextmanager
    def staging(self, hold: Callable[[StagedChange], None]) -> Iterator[None]:
        """Within this, a client's declare, bind, unbind or exchange delete is staged for
        the loop turn's group commit (`Committer.stage_delta`) instead of written at
        once; `hold` is given each staged change before the method's reply is sent."""
        previous, self._stage = self._stage, hold
        try:
            yield
        finally:
            self._stage = previous

    def _save_or_undo(
        self,
        delta: DefinitionsDelta,
        undo: Callable[[], object],
        refused: str,
        method: tuple[int, int],
        *,
        stage: bool = True,
    ) -> None:
        """Save a topology change; if the disk refuses it, `undo` it in memory and refuse it.

        What the topology file lacks must not be in memory either (finding 11): a
        queue declared there takes confirms whose messages recovery drops, a queue
        deleted there comes back with its messages at the next restart. Undone, the
        client's retry saves it once the disk has room. A passive (its topology is the
        active's, `apply_definitions`) gets the JournalError itself: it stops, exit 75.

        In a channel's method (`staging`) and with `stage`, the change is staged: the
        write is the loop turn's group commit, the outcome comes later (`StagedChange`;
        a refused change is undone then, the group's last first). `stage=False` for a
        change whose caller goes on to do what cannot be undone (a queue's delete
        purges it): saved at once, with whatever was staged before it.
        """
        hold = self._stage
        undo = self._told_undo(undo)
        if stage and hold is not None and not self.replica:
            change = StagedChange()
            self.root._by_qid = None

            def done(error: JournalError | None) -> None:
                if error is None:
                    self._saved(delta)
                    change.resolve(None)
                    return
                undo()
                self.root._by_qid = None
                change.resolve(
                    channel_error(
                        ReplyCode.INTERNAL_ERROR,
                        f"{refused}: the topology could not be saved ({error})",
                        method,
                    )
                )

            self.committer.stage_delta(delta, self.all_definitions, done)
            hold(change)
            return
        try:
            self._save(delta)
        except JournalError as exc:
            undo()
            self.root._by_qid = None
            if self.replica:
                raise
            raise channel_error(
                ReplyCode.INTERNAL_ERROR,
                f"{refused}: the topology could not be saved ({exc})",
                method,
            ) from exc

    def _told_undo(self, undo: Callable[[], object]) -> Callable[[], None]:
        # An undone change is a change too (rare: a disk refused it): the state's
        # subscribers compare everything rather than each undo saying what it restores.
        def undone() -> None:
            undo()
            self._state_changed(EVERYTHING)

        return undone

    # -- exchanges --------------------------------------------------------------------------

    def declare_exchange(
        self,
        name: str,
        etype: str,
        *,
        passive: bool,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: dict[str, Any],
    ) -> None:
        """`exchange.declare`, with RabbitMQ's checks and reply codes."""
        existing = self.exchanges.get(name)
        if passive:
            if existing is None:
                raise channel_error(
                    ReplyCode.NOT_FOUND,
                    f"no exchange '{name}' in vhost '{self.name}'",
                    EXCHANGE_DECLARE,
                )
            return
        if name.startswith("amq.") and existing is None:
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"exchange name '{name}' contains reserved prefix 'amq.*'",
                EXCHANGE_DECLARE,
            )
        if etype not in EXCHANGE_TYPES:
            raise channel_error(
                ReplyCode.COMMAND_INVALID,
                f"unknown exchange type '{etype}'",
                EXCHANGE_DECLARE,
            )
        if existing is not None:
            d = existing.definition
            if (d.type, d.durable, d.auto_delete, d.internal) != (
                etype,
                durable,
                auto_delete,
                internal,
            ):
                raise channel_error(
                    ReplyCode.PRECONDITION_FAILED,
                    f"inequivalent arg 'type' or flags for exchange '{name}' in vhost "
                    f"'{self.name}': "
                    f"received '{etype}' durable={durable} but current is '{d.type}' "
                    f"durable={d.durable}",
                    EXCHANGE_DECLARE,
                )
            return
        definition = ExchangeDef(
            name=name,
            type=etype,
            vhost=self.name,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=arguments,
        )
        self.exchanges[name] = make_exchange(definition)
        if durable:
            self._save_or_undo(
                self._delta(add_exchanges=[definition]),
                lambda: self.exchanges.pop(name, None),
                f"exchange '{name}' not declared",
                EXCHANGE_DECLARE,
            )
        self._definitions_changed(Touched(exchanges=(name,)))

    def delete_exchange(self, name: str, *, if_unused: bool) -> None:
        """`exchange.delete`; deleting a missing exchange succeeds, as in RabbitMQ."""
        if name == "" or name.startswith("amq."):
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"operation not permitted on the default or amq.* exchange '{name}'",
                EXCHANGE_DELETE,
            )
        exchange = self.exchanges.get(name)
        if exchange is None:
            return
        if if_unused and exchange.bindings:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED,
                f"exchange '{name}' in vhost '{self.name}' in use",
                EXCHANGE_DELETE,
            )
        del self.exchanges[name]
        touched = Touched(exchanges=(name,))
        if exchange.bindings:
            self._bindings_changed(name, touched)
        if exchange.definition.durable:
            self._save_or_undo(
                self._delta(del_exchanges=[name]),
                lambda: self.exchanges.setdefault(name, exchange),
                f"exchange '{name}' not deleted",
                EXCHANGE_DELETE,
            )
        self._definitions_changed(touched)

    def exchange_for_publish(self, name: str) -> Exchange:
        """The exchange a publish names (404 when missing, 403 when internal)."""
        exchange = self.exchanges.get(name)
        if exchange is None:
            raise channel_error(
                ReplyCode.NOT_FOUND, f"no exchange '{name}' in vhost '{self.name}'", BASIC_PUBLISH
            )
        if exchange.definition.internal:
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"cannot publish to internal exchange '{name}' in vhost '{self.name}'",
                BASIC_PUBLISH,
            )
        return exchange

    # -- queues -----------------------------------------------------------------------------

    def queue(self, name: str, owner: object, method: tuple[int, int]) -> Queue:
        """Look up a queue for `owner`'s connection (404 missing, 405 exclusive elsewhere)."""
        queue = self.queues.get(name)
        if queue is None:
            raise channel_error(
                ReplyCode.NOT_FOUND, f"no queue '{name}' in vhost '{self.name}'", method
            )
        if queue.owner is not None and queue.owner is not owner:
            raise channel_error(
                ReplyCode.RESOURCE_LOCKED,
                f"cannot obtain exclusive access to locked queue '{name}' in vhost '{self.name}'",
                method,
            )
        return queue

    def declare_queue(
        self,
        name: str,
        *,
        passive: bool,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: dict[str, Any],
        owner: object,
    ) -> Queue:
        """`queue.declare`, with RabbitMQ's equivalence checks; "" gets a server name."""
        if passive:
            # An inspection, not a use: it does not restart the x-expires countdown.
            return self.queue(name, owner, QUEUE_DECLARE)
        if not name:
            name = self.server_named_prefix + secrets.token_urlsafe(16)
        elif name.startswith("amq."):
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"queue name '{name}' contains reserved prefix 'amq.*'",
                QUEUE_DECLARE,
            )
        existing = self.queues.get(name)
        if existing is not None:
            queue = self.queue(name, owner, QUEUE_DECLARE)
            d = existing.definition
            for flag, have, want in (
                ("durable", d.durable, durable),
                ("exclusive", d.exclusive, exclusive),
                ("auto_delete", d.auto_delete, auto_delete),
            ):
                if have != want:
                    raise channel_error(
                        ReplyCode.PRECONDITION_FAILED,
                        f"inequivalent arg '{flag}' for queue '{name}' in vhost '{self.name}': "
                        f"received '{str(want).lower()}' but current is '{str(have).lower()}'",
                        QUEUE_DECLARE,
                    )
            for key in set(d.arguments) | set(arguments):
                if key.startswith("x-") and d.arguments.get(key) != arguments.get(key):
                    raise channel_error(
                        ReplyCode.PRECONDITION_FAILED,
                        f"inequivalent arg '{key}' for queue '{name}' in vhost '{self.name}': "
                        f"received {arguments.get(key)!r} but current is {d.arguments.get(key)!r}",
                        QUEUE_DECLARE,
                    )
            self._touch(queue)
            return queue
        if self.max_queues and len(self.queues) >= self.max_queues:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED,
                f"cannot declare queue '{name}' in vhost '{self.name}': queue limit "
                f"({self.max_queues}) is reached",
                QUEUE_DECLARE,
            )
        definition = QueueDef(
            name=name,
            qid=self.next_qid,
            vhost=self.name,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=arguments,
        )
        queue = Queue(definition, owner if exclusive else None, self._dropped, self.visibility)
        self.next_qid += 1
        self.queues[name] = queue
        # Every queue is bound to the default exchange under its own name.
        default = self._default_binding(name)
        self.exchanges[""].bind(default)
        if durable:

            def undo() -> None:
                if self.queues.get(name) is queue:
                    del self.queues[name]
                self.exchanges[""].unbind(default)
                # A staged declare is undone after `_touch` below: no expiry of it.
                queue.deleted = True
                timer = self._expiry_timers.pop(name, None)
                if timer is not None:
                    timer.cancel()
                self._queues_changed()

            self._save_or_undo(
                self._delta(add_queues=[definition], next_qid=self.next_qid),
                undo,
                f"queue '{name}' not declared",
                QUEUE_DECLARE,
            )
        self._touch(queue)
        self._queues_changed()
        self._definitions_changed(Touched(queues=(name,)))
        for listener in self.queue_listeners:
            listener(queue)
        return queue

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """A durable queue the broker keeps for itself (the mirror's records), made if missing.

        `locked`: owned privately, so no client consumes, purges or deletes it (405), and
        not bound to the default exchange (recovery binds every queue), so none publishes
        into it.
        """
        queue = self.queues.get(name)
        if queue is None:
            queue = Queue(
                QueueDef(name=name, qid=qid, vhost=self.name), None, self._dropped, self.visibility
            )
            self.queues[name] = queue
            self._save(self._delta(add_queues=[queue.definition], next_qid=self.next_qid))
            self._definitions_changed(Touched(queues=(name,)))
        if locked and queue.owner is not _INTERNAL_OWNER:
            queue.owner = _INTERNAL_OWNER
            self.exchanges[""].unbind(self._default_binding(name))
        return queue

    def delete_queue(self, name: str, *, if_unused: bool, if_empty: bool, owner: object) -> int:
        """`queue.delete`; returns the number of ready messages deleted with it."""
        if name not in self.queues:
            return 0
        queue = self.queue(name, owner, QUEUE_DELETE)
        if if_unused and queue.consumers:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED,
                f"queue '{name}' in vhost '{self.name}' in use",
                QUEUE_DELETE,
            )
        if if_empty and queue.message_count:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED,
                f"queue '{name}' in vhost '{self.name}' is not empty",
                QUEUE_DELETE,
            )
        return self.remove_queue(queue)

    def remove_queue(self, queue: Queue) -> int:
        """Delete a queue: cancel its consumers, unbind it, drop its messages.

        A durable one is first taken out of the topology and that saved: if the disk
        refuses, it is put back, untouched (541, `_save_or_undo`).
        """
        count = queue.message_count
        del self.queues[queue.name]
        unbound = [(e, e.unbind_queue(queue.name)) for e in list(self.exchanges.values())]
        auto_deleted = [
            e for e, gone in unbound if gone and e.definition.auto_delete and not e.bindings
        ]
        for exchange in auto_deleted:
            del self.exchanges[exchange.name]
        # The queue's bindings: those the subscribers last heard of under its name.
        touched = Touched(exchanges=tuple(e.name for e in auto_deleted), queues=(queue.name,))
        for exchange, gone in unbound:
            if gone:
                self._bindings_changed(exchange.name, touched)
        # A durable exchange auto-deleted with a transient queue's bindings goes too.
        gone_exchanges = [e.name for e in auto_deleted if e.definition.durable]
        if queue.durable or gone_exchanges:

            def undo() -> None:
                self.queues[queue.name] = queue
                for exchange in auto_deleted:
                    self.exchanges[exchange.name] = exchange
                for exchange, gone in unbound:
                    for binding in gone:
                        exchange.bind(binding)

            self._save_or_undo(
                self._delta(
                    del_queues=[queue.name] if queue.durable else [],
                    del_exchanges=gone_exchanges,
                ),
                undo,
                f"queue '{queue.name}' not deleted",
                QUEUE_DELETE,
                stage=False,  # its purge and consumer cancels below cannot be undone
            )
        queue.deleted = True
        for timer in (
            self._timers.pop(queue.name, None),
            self._expiry_timers.pop(queue.name, None),
        ):
            if timer is not None:
                timer.cancel()
        for consumer in list(queue.consumers):
            cancel = getattr(consumer, "cancelled_by_server", None)
            if cancel is not None:
                cancel()
        queue.consumers.clear()
        queue.purge()
        if queue.held_aside:
            metrics.HELD_ASIDE.dec(len(queue.held_aside))
            queue.held_aside.clear()
        if queue.durable:
            self.committer.drop_queue(queue.definition.qid)
        self._queues_changed()
        self._definitions_changed(touched)
        return count

    def purge_queue(self, name: str, owner: object) -> int:
        """`queue.purge`: drop the ready messages (not the unacknowledged ones)."""
        queue = self.queue(name, owner, QUEUE_PURGE)
        gone = queue.purge()
        self._settle_entries(queue, gone)
        return len(gone)

    def bind(
        self,
        queue_name: str,
        exchange_name: str,
        routing_key: str,
        arguments: dict[str, Any],
        owner: object,
        *,
        unbind: bool = False,
    ) -> None:
        """`queue.bind` / `queue.unbind`."""
        method = QUEUE_UNBIND if unbind else QUEUE_BIND
        queue = self.queue(queue_name, owner, method)
        exchange = self.exchanges.get(exchange_name)
        if exchange is None:
            raise channel_error(
                ReplyCode.NOT_FOUND, f"no exchange '{exchange_name}' in vhost '{self.name}'", method
            )
        if exchange_name == "":
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                "operation not permitted on the default exchange",
                method,
            )
        binding = BindingDef(
            exchange=exchange_name,
            queue=queue.name,
            routing_key=routing_key,
            arguments=arguments,
            vhost=self.name,
        )
        changed = exchange.unbind(binding) if unbind else exchange.bind(binding)
        auto_deleted = (
            unbind and changed and exchange.definition.auto_delete and not exchange.bindings
        )
        if changed:
            self._bindings_changed(
                exchange_name,
                Touched(exchanges=(exchange_name,) if auto_deleted else (), bindings=(binding,)),
            )
        if auto_deleted:
            del self.exchanges[exchange_name]
        stored = queue.durable and exchange.definition.durable
        if changed and (stored or (auto_deleted and exchange.definition.durable)):
            delta = self._delta(
                add_bindings=[binding] if stored and not unbind else [],
                del_bindings=[binding] if stored and unbind else [],
                del_exchanges=[exchange_name] if auto_deleted else [],
            )

            def undo() -> None:
                self.exchanges[exchange_name] = exchange  # (auto-deleted by the unbind)
                if unbind:
                    exchange.bind(binding)
                else:
                    exchange.unbind(binding)

            done = "unbound" if unbind else "bound"
            self._save_or_undo(delta, undo, f"queue '{queue.name}' not {done}", method)

    def _bindings_changed(self, exchange: str, touched: Touched) -> None:
        for listener in self.binding_listeners:
            listener(exchange)
        self._definitions_changed(touched)

    def _definitions_changed(self, touched: Touched) -> None:
        for listener in self.definition_listeners:
            listener()
        self._state_changed(touched)

    def _state_changed(self, touched: Touched) -> None:
        for listener in self.state_listeners:
            listener(touched)

    def connection_closed(self, owner: object) -> None:
        """Delete the exclusive queues of a closed connection."""
        for queue in [q for q in self.queues.values() if q.owner is owner]:
            self.remove_queue(queue)

    def consumer_removed(self, queue: Queue) -> None:
        """An auto-delete queue goes when its last consumer does."""
        if queue.deleted:
            return
        if queue.definition.auto_delete and queue.had_consumers and not queue.consumers:
            self.remove_queue(queue)
            return
        self._touch(queue)

    def _touch(self, queue: Queue) -> None:
        """Restart the `x-expires` countdown of an unused queue."""
        expires = queue.args.expires
        if expires is None or self.replica:
            return
        timer = self._expiry_timers.pop(queue.name, None)
        if timer is not None:
            timer.cancel()

        def fire() -> None:
            self._expiry_timers.pop(queue.name, None)
            if not queue.deleted and not queue.consumers:
                log.info("queue %r expired after %d ms unused", queue.name, expires)
                self.remove_queue(queue)

        self._expiry_timers[queue.name] = self.clock.call_later(expires / 1000, fire)

    def touch(self, queue: Queue) -> None:
        """Note a use of the queue (basic.get, consume) for `x-expires`."""
        self._touch(queue)

    # -- messages ---------------------------------------------------------------------------

    def publish(
        self,
        exchange: Exchange,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        ops: list[JournalOp] | None = None,
        *,
        deduplicate: bool = False,
        hold: bool = False,
        forward: bool = True,
        admission: Admission = "publish",
    ) -> PublishResult:
        """Route a message into its queues; persistent copies in durable queues are journaled.

        With `ops` given (a transaction), journal operations are collected there
        instead of being committed, and the result's `dedup_key` is for the caller to
        pass to `remember_when_durable` with the commit's batch. Every routed publish
        with a message id is remembered in the dedup window once durable; only a
        `deduplicate` publisher (one that opted in) has its re-sends dropped, so plain
        clients see RabbitMQ's behaviour. With `hold` (a publisher in confirm mode) the
        message is visible only once the batch its confirm waits for is complete. A
        message published on an exchange in `forwarding` also goes to that exchange's
        federation outbox, unless `forward` is False (it came down a federation link).
        `admission`: how the queues' refusing limits apply (`Admission`).
        """
        if forward:
            rewrite = self.reply_to_rewriters.get(exchange.name)
            if rewrite is not None:
                header = rewrite(header)
        message_id = info.message_id
        key = None
        if message_id is not None and self.dedup.size:
            key = scoped_dedup_key(self.name, exchange.name, routing_key, message_id)
            if deduplicate and key in self.dedup:
                # A re-send of a message we have, durably: confirm it, do not enqueue it.
                metrics.DUPLICATES.inc()
                return PublishResult(
                    1, False, 0 if ops is not None else self.committer.confirm_point()
                )
            original = self.dedup.pending_batch(key) if deduplicate and ops is None else None
            if original is not None:
                # A re-send racing its original's batch: not enqueued again; its confirm
                # waits for that batch and shares its outcome (a failed write nacks both).
                metrics.DUPLICATES.inc()
                return PublishResult(1, False, original, depends_on=original)
        result = self._route(
            exchange, routing_key, header, body, info, ops, hold, forward, admission
        )
        # A publish a queue refused leaves no id: its re-send must reach that queue.
        if key is not None and result.routed and not result.rejected:
            if ops is None:
                self.remember_when_durable([key], result.batch)
            else:
                result.dedup_key = key
        return result

    def remember_when_durable(self, keys: list[str], batch: int) -> None:
        """Add dedup keys to the window once `batch` is durable; forget them if it fails."""
        for key in keys:
            self.dedup.add_when_durable(key, batch)
        if batch:
            self.committer.await_durable(self.dedup)

    def forget_dedup_window(self) -> None:
        """Drop every admitted dedup key; keys waiting for their batch stay (passive)."""
        self.dedup.forget_admitted()

    def forget_dedup_keys(self, keys: list[str]) -> None:
        """Drop these dedup keys, admitted or waiting: their batch failed on the active
        (passive; a key kept would swallow the publisher's re-send once promoted)."""
        self.dedup.forget_keys(keys)

    def _route(
        self,
        exchange: Exchange,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        ops: list[JournalOp] | None,
        hold: bool,
        forward: bool,
        admission: Admission,
    ) -> PublishResult:
        targets = self._targets(exchange, routing_key, header, forward)
        if targets is None:
            # Contained to this message: refused (nacked), the channel carries on.
            return PublishResult(0, True, 0)
        if not targets:
            metrics.UNROUTABLE.inc()
            return PublishResult(0, False, 0)
        if admission == "publish":
            capping = bool(self.root.queue_cap)
            for queue in targets:
                if (capping or queue.args.overflow != "drop-head") and self._refusal(
                    queue, 1, len(body), own=True, capped=True
                ):
                    # Refused by one queue, taken by none: no copy outlives the nack (a
                    # copy kept elsewhere would give its id to the dedup window at the
                    # next start, and swallow the re-send the nack asks for). Each full
                    # reject-publish-dlx queue dead-letters it, as RabbitMQ's does.
                    refusing = [
                        (q, dlx) for q in targets
                        if (dlx := _refused_dlx(q)) is not None
                        and self._refusal(q, 1, len(body), own=True, capped=False)
                    ]  # fmt: skip
                    if refusing:
                        message = self._new_message(exchange.name, routing_key, header, body, info)
                        self._dead_letter_refused(refusing, message)
                    metrics.PUBLISHED.value += 1
                    batch = 0 if ops is not None else self.committer.confirm_point()
                    return PublishResult(0, True, batch)
        return self._enqueue(
            targets, exchange.name, routing_key, header, body, info, ops, hold,
            own=admission in ("link", "news"), capped=admission == "news",
        )  # fmt: skip

    def _new_message(
        self, exchange: str, routing_key: str, header: bytes, body: bytes, info: ContentHeaderInfo
    ) -> Message:
        """A published message, with the next message id."""
        mid = self.next_mid
        self.next_mid += 1
        return Message(
            mid, exchange, routing_key, header, body,
            info.persistent, info.expiration_ms, info.message_id,
        )  # fmt: skip

    def _dead_letter_refused(self, refusing: list[tuple[Queue, str]], message: Message) -> None:
        """Dead-letter a publish the length limit of each of these `reject-publish-dlx`
        queues refused (queue, its dead-letter exchange), with x-death reason `maxlen` as
        RabbitMQ's does. The publisher is nacked whatever happens here: a copy that cannot
        be dead-lettered is only counted and logged."""
        for queue, dlx in refusing:
            if (
                message.message_id is not None
                and dlx == message.exchange
                and (queue.args.dead_letter_routing_key or message.routing_key)
                == message.routing_key
            ):
                # Stored under the publish's own exchange and key, the copy would give
                # its dedup key to the window at the next start, and a deduplicating
                # publisher's re-send (the nack's answer) would be taken as a duplicate.
                # Logged at most once a minute: a publisher may retry its nacks in a loop.
                root, now = self.root, self.clock.time()
                if now - root.dlx_skip_logged_at >= 60:
                    root.dlx_skip_logged_at = now
                    log.warning(
                        "queue %r: a refused publish is not dead-lettered: its dead-letter "
                        "exchange and routing key are the publish's own (give the queue an "
                        "x-dead-letter-routing-key)",
                        queue.name,
                    )
                continue
            try:
                self._dead_letter(queue, message, "maxlen", dlx)
            except Exception:
                metrics.QUARANTINED.labels("dead-letter").inc()
                log.exception("queue %r: a refused publish could not be dead-lettered", queue.name)

    def _targets(
        self, exchange: Exchange, routing_key: str, header: bytes, forward: bool
    ) -> list[Queue] | None:
        """The queues a publish goes to (None: its headers cannot be routed, a bug)."""
        headers: dict[str, Any] | None = None
        if isinstance(exchange, EXCHANGE_TYPES["headers"]):
            try:
                headers = to_python(decode_headers(header))
            except Exception as exc:  # checked at publish: only a bug gets here
                metrics.QUARANTINED.labels("publish").inc()
                log.error("headers routing failed for a publish to %r: %r", exchange.name, exc)
                return None
        names = exchange.route(routing_key, headers)
        queues = self.queues
        targets = [queues[n] for n in names if n in queues]
        if not targets and not exchange.name and self.reply_router is not None:
            # The default exchange and no such queue here: a reply to another server's
            # temporary queue, routed to the federation link that asked for it.
            targets = [queues[n] for n in self.reply_router(routing_key) if n in queues]
        outbox = self.forwarding.get(exchange.name) if forward else None
        if outbox is not None and not outbox.deleted:
            # Federation forwarding: journaled with the local copies, in the same batch.
            targets.append(outbox)
        return targets

    def tx_refusal(self, publishes: Iterable[tuple[Exchange, str, bytes, int]]) -> str | None:
        """Why the queues' refusing limits refuse these publishes (exchange, routing key,
        header, body size) together, if they do: a transaction's, checked before its commit
        changes anything (AMQP has no refusal of one message of a transaction; RabbitMQ
        drops it and still answers commit-ok)."""
        added: dict[str, tuple[int, int]] = {}
        for exchange, routing_key, header, size in publishes:
            for queue in dict.fromkeys(self._targets(exchange, routing_key, header, True) or ()):
                count, total = added.get(queue.name, (0, 0))
                count, total = count + 1, total + size
                why = self._refusal(queue, count, total, own=True, capped=True)
                if why == "cap":
                    return (
                        f"queue '{queue.name}' in vhost '{self.name}' is at the broker's "
                        f"queue length limit ({self.root.queue_cap.describe()})"
                    )
                if why == "own":
                    return (
                        f"queue '{queue.name}' in vhost '{self.name}' is full (its "
                        f"x-max-length, x-overflow {queue.args.overflow})"
                    )
                added[queue.name] = (count, total)
        return None

    def _refusal(
        self, queue: Queue, count: int, size: int, *, own: bool, capped: bool
    ) -> Literal["own", "cap"] | None:
        """Whether `count` more messages of `size` body bytes in all are refused by the
        queue's own reject-publish limit (`own`) or the broker's cap (`capped`): every
        queue clients fill is capped, the federation outboxes too (the publishes on their
        exchanges fill them; uncapped, one grew without end while its upstream refused
        or was away), the broker's other own queues not."""
        if own and queue.args.overflow != "drop-head" and queue.is_full_for(count, size):
            return "own"
        cap = self.root.queue_cap
        if (
            capped
            and cap
            and cap.refuses(queue, count, size)
            and (not is_internal(queue.name) or queue in self.forwarding.values())
        ):
            self._cap_refused(queue)
            return "cap"
        return None

    def _cap_refused(self, queue: Queue) -> None:
        metrics.CAP_REFUSED.inc()
        root = self.root
        now = self.clock.time()
        # A nack carries no reason: the log says which queue, at most once a minute.
        if now - root.cap_logged_at >= 60:
            root.cap_logged_at = now
            log.warning(
                "queue %r in vhost %r is at the broker's queue length limit (%s): "
                "publishes to it are refused (twinmq_messages_refused_by_length_cap_total)",
                queue.name, self.name, root.queue_cap.describe(),
            )  # fmt: skip

    def _enqueue(
        self,
        targets: list[Queue],
        exchange: str,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        ops: list[JournalOp] | None,
        hold: bool = False,
        *,
        own: bool = True,
        capped: bool = True,
    ) -> PublishResult:
        """Put a message in `targets`; journal its persistent copies in durable queues.

        `hold` (a publisher waiting for a confirm) and a transaction (`ops`) keep the
        journaled entries from consumers until their batch is complete (visibility.py).
        Each queue takes its copy or refuses it alone: `own`, by its reject-publish limit;
        `capped`, by the broker's length cap.
        """
        now = self.clock.time()
        capped = capped and bool(self.root.queue_cap)  # once: no cap is the common case
        message = self._new_message(exchange, routing_key, header, body, info)
        mid = message.mid
        own_ops: list[JournalOp] = [] if ops is None else ops
        rejected = False
        routed = 0
        delivered: list[Queue] = []
        # Entries whose batch decides whether they are taken (see visibility.py).
        held: list[tuple[Queue, Entry]] = []
        for queue in targets:
            args = queue.args
            why = (own or capped) and self._refusal(queue, 1, len(body), own=own, capped=capped)
            if why:
                rejected = True
                dlx = _refused_dlx(queue) if why == "own" else None
                if dlx is not None:
                    self._dead_letter_refused([(queue, dlx)], message)
                continue
            ttl = info.expiration_ms
            if args.message_ttl is not None:
                ttl = args.message_ttl if ttl is None else min(ttl, args.message_ttl)
            expires_at = None if ttl is None else now + ttl / 1000
            journaled = info.persistent and queue.durable
            entry = Entry(message, expires_at, journaled)
            if journaled:
                own_ops.append(
                    StoredMessage(
                        mid, queue.definition.qid, exchange, routing_key, header, body, expires_at
                    )
                )
                if hold or ops is not None:
                    entry.batch = UNCOMMITTED
                    held.append((queue, entry))
            elif ops is not None:
                entry.batch = UNCOMMITTED
                held.append((queue, entry))
            queue.push(entry)
            routed += 1
            if ttl is not None:
                self._schedule_expiry(queue)
            delivered.append(queue)
        batch = 0
        if ops is not None:
            # The transaction's commit holds them with its batch (`Visibility.hold_transaction`).
            metrics.PUBLISHED.value += 1
            return PublishResult(routed, rejected, 0, held=held)
        if own_ops:
            batch = self.committer.add(own_ops)
            if held:
                self.visibility.hold(batch, held)
        else:
            batch = self.committer.confirm_point()
        for queue in delivered:
            queue.dispatch(now)
        metrics.PUBLISHED.value += 1
        return PublishResult(routed, rejected, batch)

    def settle(
        self, queue: Queue, entries: list[Entry], ops: list[JournalOp] | None = None
    ) -> None:
        """Entries were acknowledged: forget them (and journal that for persistent ones)."""
        for entry in entries:
            queue.delivered.pop(entry.message.mid, None)
        self._settle_entries(queue, entries, ops)

    def _settle_entries(
        self, queue: Queue, entries: Iterable[Entry], ops: list[JournalOp] | None = None
    ) -> None:
        qid = queue.definition.qid
        settles: list[JournalOp] = [Settle(qid, e.message.mid) for e in entries if e.journaled]
        if not settles or queue.deleted:
            return
        if ops is None:
            self.committer.add(settles)
        else:
            ops.extend(settles)

    def requeue(self, queue: Queue, entries: list[Entry]) -> None:
        """Delivered entries go back to the head of their queue."""
        for entry in entries:
            queue.delivered.pop(entry.message.mid, None)
        if queue.deleted:
            return
        queue.requeue(entries)
        self._schedule_expiry(queue)
        queue.dispatch(self.clock.time())

    def reject(self, queue: Queue, entries: list[Entry]) -> None:
        """Rejected without requeue: dead-letter (if configured) and settle."""
        for entry in entries:
            queue.delivered.pop(entry.message.mid, None)
        for entry in entries:
            self._dropped(queue, entry, "rejected")

    def _dropped(self, queue: Queue, entry: Entry, reason: DropReason) -> None:
        """A queue let go of an entry: dead-letter it if configured, settle it.

        Whatever goes wrong while dead-lettering stays with this message: it is
        quarantined (kept unsettled) and the caller (an innocent publisher whose
        publish pushed it out, a consumer's reject, an expiry timer) carries on.
        """
        dlx = queue.args.dead_letter_exchange
        if dlx is not None and reason != "delete":
            try:
                self._dead_letter(queue, entry.message, reason, dlx)
            except Exception as exc:
                queue.hold_aside(entry, "dead-letter", exc)
                return
        self._settle_entries(queue, (entry,))
        if reason == "expired":
            metrics.EXPIRED.inc()

    def _dead_letter(
        self, queue: Queue, message: Message, reason: DropReason, dlx_name: str
    ) -> None:
        exchange = self.exchanges.get(dlx_name)
        if exchange is None:
            log.warning("dead-letter exchange %r of queue %r is missing", dlx_name, queue.name)
            return
        if reason == "delete":
            return
        routing_key = queue.args.dead_letter_routing_key or message.routing_key
        try:
            dead = dead_letter_header(
                message.header,
                queue=queue.name,
                reason=reason,
                exchange=message.exchange,
                routing_key=message.routing_key,
                now=int(self.clock.time()),
            )
        except ValueError as exc:
            # A header that never passed this broker's publish checks (stored by another
            # version): forwarded unchanged rather than lost.
            metrics.QUARANTINED.labels("dead-letter").inc()
            log.error(
                "queue %r: message %d dead-lettered with its header unchanged (undecodable: %s)",
                queue.name,
                message.mid,
                exc,
            )
            header, headers, cycle_check = message.header, None, None
        else:
            header, headers, cycle_check = dead.header, to_python(dead.headers), dead.headers
        names = exchange.route(routing_key, headers)
        targets = []
        for name in dict.fromkeys(names):
            target = self.queues.get(name)
            if target is None:
                continue
            if cycle_check is not None and is_cycle(cycle_check, name):
                log.info(
                    "dropping message %d: dead-lettering it from %r into %r closes a cycle",
                    message.mid,
                    queue.name,
                    name,
                )
                continue
            targets.append(target)
        info = ContentHeaderInfo(
            60, len(message.body), message.persistent, None, message.message_id
        )
        if targets:
            self._enqueue(targets, exchange.name, routing_key, header, message.body, info, None)
        metrics.DEAD_LETTERED.inc()

    def _schedule_expiry(self, queue: Queue) -> None:
        """Keep one timer per queue for its head's expiry."""
        at = queue.next_expiry()
        if at is None or queue.name in self._timers or self.replica:
            return

        def fire() -> None:
            self._timers.pop(queue.name, None)
            if queue.deleted:
                return
            queue.expire(self.clock.time())
            self._schedule_expiry(queue)

        delay = at - self.clock.time()
        # A far (or non-finite) deadline read back from disk re-arms daily instead of
        # overflowing the event loop's timer: `fire` looks at the head again anyway.
        delay = min(delay, _MAX_TIMER) if delay > 0 else 0.0
        self._timers[queue.name] = self.clock.call_later(delay, fire)

    # -- replication ----------------------------------------------------------------------

    def queue_by_qid(self, qid: int) -> Queue | None:
        """The queue of an incarnation id, if it exists."""
        return self._qid_index().get(qid)

    def _qid_index(self) -> dict[int, Queue]:
        root = self.root
        if root._by_qid is None:
            root._by_qid = {q.definition.qid: q for q in self.all_queues()}
            root._other_qids = frozenset(
                qid for qid, q in root._by_qid.items() if q.definition.vhost != root.name
            )
        return root._by_qid

    def other_vhost_qids(self) -> frozenset[int]:
        """The qids of the queues in vhosts other than `/`: what the DR mirror skips."""
        root = self.root
        if len(root.vhosts) == 1:
            return frozenset()
        self._qid_index()
        return root._other_qids

    def replication_snapshot(self) -> dict[int, list[int]]:
        """The replication IDs this broker holds per durable queue (journaled messages)."""
        return {
            q.definition.qid: [e.message.mid for e in q.entries if e.journaled]
            + [mid for mid, e in q.delivered.items() if e.journaled]
            + [mid for mid, e in q.held_aside.items() if e.journaled]
            for q in self.all_queues()
            if q.durable
        }

    def apply_definitions(self, defs: Definitions, served: Collection[str] | None = None) -> None:
        """Make the topology of every vhost equal to the active's (a passive receiving its
        definitions); a vhost the active has and this broker not yet is made.

        With `served` (the vhosts this broker's users file declares): a vhost that `defs`
        does not name and `served` does not hold, emptied here, is dropped: the active
        deleted it while this passive was not linked (`DELETE /vhosts/{name}`)."""
        root = self.root
        named = defs.vhost_names()
        for name in sorted(named | set(root.vhosts)):
            vhost = root.add_vhost(name)
            vhost._replace_topology(defs.of_vhost(name))
            if served is not None and vhost is not root and name not in named | set(served):
                vhost._drop()
                log.warning("vhost %r is not on the active nor in the users file: dropped", name)
        everything = root.all_definitions()
        self.committer.save_definitions(everything)
        self._queues_changed()
        if not root.replica and root.on_topology_change is not None:
            # An active replacing its topology whole (the DR mirror's applier): its passive
            # gets it whole too, durable here first and before the batch that uses it.
            # Told nothing, the passive skipped the messages of the queues it did not know
            # and, promoted, lacked them (`tests/test_mirror_replica_pair.py`).
            root.on_topology_change(everything)

    def _replace_topology(self, defs: Definitions) -> None:
        wanted = {q.name: q for q in defs.queues}
        for queue in list(self.queues.values()):
            target = wanted.get(queue.name)
            if target is None or target.qid != queue.definition.qid:
                self.remove_queue(queue)
        for qdef in defs.queues:
            if qdef.name not in self.queues:
                self.queues[qdef.name] = Queue(
                    qdef, None, self._dropped, self.visibility, lenient=True
                )
                self.exchanges[""].bind(self._default_binding(qdef.name))
        builtin = {name for name, _ in BUILTIN_EXCHANGES}
        for name in [n for n in self.exchanges if n not in builtin]:
            del self.exchanges[name]
        for exchange in self.exchanges.values():
            if exchange.name != "":
                for binding in list(exchange.bindings.values()):
                    exchange.unbind(binding)
        for edef in defs.exchanges:
            self.exchanges[edef.name] = make_exchange(edef)
        for bdef in defs.bindings:
            bound = self.exchanges.get(bdef.exchange)
            if bound is not None and bdef.queue in self.queues:
                bound.bind(bdef)
        self.next_qid = max(self.next_qid, defs.next_qid)
        self.root._by_qid = None
        self._state_changed(EVERYTHING)  # (nothing is published on a passive)

    def apply_delta(
        self,
        delta: DefinitionsDelta,
        staged: Callable[[JournalError | None], None] | None = None,
    ) -> None:
        """Apply one topology change of the active (a passive receiving DEFINITIONS_DELTA).

        Queues the delta removes or replaces (another qid under the name) go first, each
        by `remove_queue` (which records its own removal); then the rest is applied in
        memory and the delta recorded. A JournalError reaches the caller (the passive
        stops, as for `apply_definitions`).

        `staged`: the delta is staged for the group commit instead (`Committer.stage_delta`:
        the changes staged together are one append and one fsync of the definitions
        log), and `staged` is told its outcome; the caller writes the group
        (`flush_topology`) before it acknowledges anything after it.
        """
        if delta.drop_vhost:
            # The active deleted the vhost (`delete_content`): drop it here too, so that
            # this broker's vhosts are the active's, not only after a restart.
            gone = self.root.vhosts.get(delta.vhost)
            if gone is not None and gone is not self.root:
                for left in list(gone.queues.values()):
                    gone.remove_queue(left)  # none: their deltas came first
                gone._drop()
                log.warning("vhost %r deleted on the active: dropped", delta.vhost)
            self._record_applied(delta, staged)
            return
        if delta.vhost != self.name:
            self.add_vhost(delta.vhost).apply_delta(delta, staged)
            return
        replaced = {q.name for q in delta.add_queues if (old := self.queues.get(q.name))
                    and old.definition.qid != q.qid}  # fmt: skip
        for name in [*delta.del_queues, *replaced]:
            queue = self.queues.get(name)
            if queue is not None:
                self.remove_queue(queue)
        builtin = {name for name, _ in BUILTIN_EXCHANGES}
        for bdef in delta.del_bindings:
            bound = self.exchanges.get(bdef.exchange)
            if bound is not None:
                bound.unbind(bdef)
        for name in delta.del_exchanges:
            if name not in builtin:
                self.exchanges.pop(name, None)
        for edef in delta.add_exchanges:
            old_exchange = self.exchanges.get(edef.name)
            if old_exchange is None or old_exchange.definition != edef:
                self.exchanges[edef.name] = exchange = make_exchange(edef)
                for binding in () if old_exchange is None else old_exchange.bindings.values():
                    exchange.bind(binding)
        for qdef in delta.add_queues:
            if qdef.name not in self.queues:
                self.queues[qdef.name] = Queue(
                    qdef, None, self._dropped, self.visibility, lenient=True
                )
                self.exchanges[""].bind(self._default_binding(qdef.name))
        for bdef in delta.add_bindings:
            bound = self.exchanges.get(bdef.exchange)
            if bound is not None and bdef.queue in self.queues:
                bound.bind(bdef)
        self.next_qid = max(self.next_qid, delta.next_qid)
        self.root._by_qid = None
        self._queues_changed()
        self._state_changed(EVERYTHING)  # (nothing is published on a passive)
        # Last, as `apply_definitions` saves: a failure stops this passive (exit 75).
        self._record_applied(delta, staged)

    def _record_applied(
        self, delta: DefinitionsDelta, staged: Callable[[JournalError | None], None] | None
    ) -> None:
        """Record a delta a passive applied: staged for the group commit, or now."""
        if staged is not None:
            self.committer.stage_delta(delta, self.all_definitions, staged)
        else:
            self.committer.save_delta(delta, self.all_definitions)

    def apply_ops(
        self, ops: list[JournalOp], *, defer_sort: bool = False, catchup: bool = False
    ) -> list[str]:
        """Apply a replicated batch to the queues (the caller journals it).

        Returns the dedup keys of its messages: the caller passes them to
        `remember_when_durable` with the local batch it journals them in, so that
        this broker, promoted, never swallows a re-send of a message it has not
        made durable (as the active's window admits keys only once durable).
        A settle in a `catchup` chunk is a discard: the active does not hold the
        message (dequeued meanwhile, or never taken: its batch failed there, or it
        was never confirmed before a failover), so its key leaves the window too: a
        key without its message would swallow the re-send of a message nobody has.
        Queues keep replication ID order; with `defer_sort` (a catch-up, whose
        chunks of older messages interleave with live batches) a queue put out of
        order is sorted once, by `restore_order`, instead of after every batch.
        """
        unordered: set[Queue] = set()
        keys: list[str] = []
        queue_of = self._qid_index().get
        next_mid = self.next_mid
        dedup = self.dedup.size > 0
        # A chunk's ops are mostly of one queue, in order: its queue looked up once,
        # and the order checked against the last mid appended (per message: a Message
        # and an Entry, nothing else).
        qid = last = -1
        queue: Queue | None = None
        for op in ops:
            if op.qid != qid:
                qid = op.qid
                queue = queue_of(qid)
                last = queue.entries[-1].message.mid if queue is not None and queue.entries else -1
            if queue is None:
                continue  # a queue deleted since: the topology says so
            if type(op) is StoredMessage:
                mid = op.mid
                header, body = op.header, op.body
                message_id = header_message_id(header)
                message = Message(
                    mid, op.exchange, op.routing_key, header, body, True, None, message_id
                )
                if message_id is not None and dedup:
                    keys.append(
                        scoped_dedup_key(
                            queue.definition.vhost, op.exchange, op.routing_key, message_id
                        )
                    )
                if last > mid:
                    unordered.add(queue)
                last = mid
                queue.entries.append(Entry(message, op.expires_at, True))
                queue.bytes += len(body)
                if mid >= next_mid:
                    next_mid = mid + 1
            else:
                gone = queue.remove_mid(op.mid)
                if catchup and gone is not None:
                    settled = gone.message
                    if settled.message_id is not None:
                        self.dedup.forget(
                            scoped_dedup_key(
                                queue.definition.vhost,
                                settled.exchange,
                                settled.routing_key,
                                settled.message_id,
                            )
                        )
        self.next_mid = next_mid
        self._unordered |= unordered
        if not defer_sort:
            self.restore_order()
        return keys

    def restore_order(self) -> None:
        """Sort the queues replicated batches put out of replication ID order."""
        for queue in self._unordered:
            queue.sort_by_mid()
        self._unordered.clear()

    def set_replica(self, replica: bool) -> None:
        """Become a passive (no timers, state from replication) or an active broker (the
        root: with every vhost)."""
        if self.root is self:
            for other in list(self.vhosts.values()):
                if other is not self:
                    other.set_replica(replica)
        self.replica = replica
        self.restore_order()  # a catch-up cut short leaves its queues unsorted
        if replica:
            for timer in [*self._timers.values(), *self._expiry_timers.values()]:
                timer.cancel()
            self._timers.clear()
            self._expiry_timers.clear()
            return
        now = self.clock.time()
        for queue in list(self.queues.values()):
            # Replicated or mirrored here, each may have been delivered by the broker or
            # site this one takes over from (deliveries are not replicated): flagged as
            # recovery flags what it reads from disk, so consumers can tell.
            for entry in queue.entries:
                entry.redelivered = True
            queue.expire(now)
            self._schedule_expiry(queue)
            self._touch(queue)


_MAX_TIMER = 86400.0
_INTERNAL_OWNER = object()  # owns the internal queues: no client connection is it


def _refused_dlx(queue: Queue) -> str | None:
    """Where `queue` dead-letters the publishes its length limit refuses, if it does
    (`x-overflow: reject-publish-dlx` with a dead-letter exchange)."""
    args = queue.args
    return args.dead_letter_exchange if args.overflow == "reject-publish-dlx" else None


def _recovered_header(header: bytes) -> tuple[str | None, str | None]:
    """A stored header's message id, and why it would be refused today (None if it would not)."""
    try:
        return decode_content_header(header).message_id, None
    except AMQPError as exc:
        return None, exc.text


def _names_fit(message: Message) -> bool:
    """Whether the exchange and routing key fit basic.deliver's short strings."""
    return (
        len(message.exchange.encode("utf-8", "surrogatepass")) <= 255
        and len(message.routing_key.encode("utf-8", "surrogatepass")) <= 255
    )
