"""Federation wired into a broker: its links (downstream side) and its peers (upstream side).

The broker gives it the settings, the virtual host, the committer and its alarm; the
links run only while the broker is active (a pair's passive takes over at promotion).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from twinmq.broker.api import (
    FederationBinding,
    FederationLinkStatus,
    FederationStatus,
    PeerStateStatus,
    StateReplicationStatus,
)
from twinmq.broker.codec import ContentHeaderInfo, decode_headers
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.federation import metrics
from twinmq.broker.federation import peer as peer_status
from twinmq.broker.federation.agent import QUEUE_PREFIX, FederationLink, queue_name
from twinmq.broker.federation.config import FederationConfig
from twinmq.broker.federation.dedup import QUEUE_NAME as DEDUP_QUEUE
from twinmq.broker.federation.dedup import DurableKeys, scoped, scoped_origin, unscoped_origin
from twinmq.broker.federation.globalkeys import GlobalKeys
from twinmq.broker.federation.headers import forwarded
from twinmq.broker.federation.identity import PEER_EXCHANGE, duplicate_refusal
from twinmq.broker.federation.marks import ToldMarks
from twinmq.broker.federation.orphans import LinkQueue, Orphans
from twinmq.broker.federation.state import StatePublisher
from twinmq.broker.fieldtable import to_python
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.routing import Exchange
from twinmq.broker.vhost import PublishResult, VirtualHost

log = logging.getLogger(__name__)

SERVER_NAMED_PREFIX = "amq.gen-"

REFUSALS_KEPT = 20


class Federation:
    """The broker's federation: links from the federation file, refusals of peers."""

    def __init__(
        self,
        server_id: str,
        config: FederationConfig | None,
        vhost: VirtualHost,
        committer: GroupCommitter,
        alarm: Callable[[], str | None],
        state_dir: Path,
        epoch: Callable[[], int] = lambda: 0,
    ) -> None:
        self.server_id = server_id
        self.vhost = vhost
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSALS_KEPT)
        self.links: dict[str, FederationLink] = {}
        self.running = False
        self.forwarded_received = 0
        self.forwarded_dropped = 0
        # Forwarded messages in flight, by key: (the batch their confirm waits for, that
        # batch's outcome). A re-send meanwhile shares it (`receive`).
        self._forwards: dict[str, tuple[int, asyncio.Future[bool]]] = {}
        # Per vhost, the origins downstreams have forwarded here since the start: their
        # messages enter the exchanges by no link, so nothing is told about them, nor
        # about unnamed origins (`told_marks`).
        self._forward_origins: dict[str, set[str]] = {}
        self.peer_status_received = 0  # downstreams' status messages published on amq.peer
        self.peer_status_dropped = 0
        self._peer_drop_logged = False
        # One window for every link, and for what downstreams forward here: a message
        # arriving by two paths is published once.
        self.keys = keys = DurableKeys(
            config.dedup_window if config is not None else FederationConfig().dedup_window
        )
        self._keys_loaded = False
        self.batches = batches = BatchFutures()
        committer.await_durable(batches)
        self.epoch = epoch
        self.status_interval = config.status_interval_seconds if config is not None else 0.0
        self._status_task: asyncio.Task[None] | None = None
        # Per vhost: the link queues held there (cached between definition changes).
        self._link_queues: dict[str, list[str]] = {}
        self._separator = separator = config.global_key_separator if config is not None else "."
        # Global keys per vhost: a temporary queue is bound to its own vhost's exchanges.
        global_exchanges: dict[str, list[str]] = {}
        for fed in config.exchanges if config is not None else []:
            if fed.global_keys:
                global_exchanges.setdefault(fed.vhost, []).append(fed.exchange)
        self.global_keys: dict[str, GlobalKeys] = {
            name: GlobalKeys(server_id, separator, vhost.add_vhost(name), exchanges)
            for name, exchanges in global_exchanges.items()
        }
        # Every server publishes each vhost's definitions on that vhost's
        # `amq.twinmq.state` (state replication), links or not; `state` is `/`'s.
        self.states: dict[str, StatePublisher] = {}
        self.upstreams = dict(config.upstreams) if config is not None else {}
        if config is not None:
            for fed in config.exchanges:
                local = vhost.add_vhost(fed.vhost)
                self.links[fed.link_id] = FederationLink(
                    fed, fed.upstream, config.upstreams[fed.upstream], server_id, local,
                    batches, alarm, state_dir, keys,
                )  # fmt: skip
        # (vhost, exchange) -> its link: the binding changes of that exchange go to it.
        self._by_exchange = {(ln.fed.vhost, ln.fed.exchange): ln for ln in self.links.values()}
        # The link queues upstream of links removed from the file (issue 15): found at
        # each start (the file may have been there before this broker was a downstream).
        self.orphans = Orphans(
            state_dir,
            server_id,
            (LinkQueue(upstream=link.upstream_name, queue=link.queue, exchange=link.fed.exchange,
                       vhost=link.upstream_vhost)
             for link in self.links.values()),
        )  # fmt: skip
        if self.links:
            state_dir.mkdir(parents=True, exist_ok=True)
        # Every vhost now and each one made later (the users file reloaded, recovery).
        for each in list(vhost.vhosts.values()):
            self._serve_vhost(each)
        vhost.vhost_listeners.append(self._serve_vhost)

    @property
    def state(self) -> StatePublisher:
        """`/`'s state publisher (the `state` of `/status`)."""
        return self.states["/"]

    def _serve_vhost(self, vhost: VirtualHost) -> None:
        """Federation in `vhost`: its state publisher, the default exchange's route to link
        queues for global keys, binding changes told to its links (docs/federation.md,
        "Virtual hosts")."""
        if vhost.name in self.states and self.states[vhost.name].vhost is vhost:
            return
        self.states[vhost.name] = StatePublisher(self.server_id, vhost, self.epoch)
        vhost.reply_router = lambda key: self.reply_queues(key, vhost)
        vhost.definition_listeners.append(lambda: self._forget_link_queues(vhost.name))
        keys = self.global_keys.get(vhost.name)
        if keys is None or keys.vhost is not vhost:  # new, or the vhost made again
            exchanges = [] if keys is None else keys.exchanges
            keys = GlobalKeys(self.server_id, self._separator, vhost, exchanges)
            self.global_keys[vhost.name] = keys
        if keys.exchanges:
            vhost.queue_listeners.append(keys.queue_declared)
            for exchange in keys.exchanges:
                vhost.reply_to_rewriters[exchange] = keys.rewrite
        for link in self.links.values():
            if link.fed.vhost == vhost.name and link.vhost is not vhost:
                # Made again (`DELETE /vhosts/{name}`, then served): the link follows,
                # else it republished into the dropped one until a restart.
                link.follow(vhost, active=self.running)
        if any(link.vhost is vhost for link in self.links.values()):
            vhost.binding_listeners.append(
                lambda exchange: self._bindings_changed(vhost.name, exchange)
            )

    def start(self) -> None:
        """Declare the local federated exchanges if missing and start the links (active)."""
        if self.running:
            return
        self.running = True
        self._keys_loaded = False
        if self.links or DEDUP_QUEUE in self.vhost.queues:
            # The records replicated or recovered here are the keys (a promoted passive's too).
            self._load_keys()
        for link in self.links.values():
            link.declare_exchange()
            link.open_outbox()
            link.start()
        if self.upstreams or self.orphans.path.exists():
            # With upstreams, even without a record (a wiped data dir): their state says
            # which link queues named for this server are there.
            self.orphans.find(self.upstreams)
            self.orphans.start(self.upstreams)
        if self.links and self.status_interval > 0:
            self._status_task = asyncio.get_running_loop().create_task(
                self._periodic_status(), name="twinmq-federation-status"
            )

    async def stop(self) -> None:
        """Stop the links (demotion, shutdown)."""
        self.running = False
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_task
            self._status_task = None
        await self.orphans.stop()
        for link in self.links.values():
            link.close_outbox()
            await link.stop()

    async def _periodic_status(self) -> None:
        """A `link-status` on amq.peer per running link, every `status-interval-seconds`:
        its lag and counts while nothing happens, and the epochs of both sides."""
        while True:
            await asyncio.sleep(self.status_interval)
            for link in self.links.values():
                if link.state != "running":
                    continue
                view = link.upstream_state
                event = peer_status.PeerEvent(
                    event="link-status", server_id=self.server_id, peer=link.upstream_id,
                    link=link.fed.exchange, upstream=link.upstream_name,
                    forward_pending=link.forward_pending, messages_received=link.received,
                    messages_forwarded=link.forwarded, epoch=self.epoch(),
                    peer_epoch=view.epoch if view is not None and view.state else None,
                    upstream_state_seq=view.seq if view is not None and view.state else None,
                    time=peer_status.now(),
                )  # fmt: skip
                peer_status.publish(link.vhost, event)
                link.send_status(event)  # and to the upstream's amq.peer (seed 002)

    def _load_keys(self) -> None:
        if not self._keys_loaded:
            self.keys.load(self.vhost)
            self._keys_loaded = True

    def receive(
        self,
        exchange: Exchange,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        *,
        hold: bool,
    ) -> PublishResult:
        """Upstream side: a message a downstream forwarded (a publish on a federation
        link's connection). A loop or a duplicate (its (origin, seq) already published
        here, or in flight) is confirmed and dropped; otherwise it is published and its
        key journaled in the same group commit, which its confirm waits for: a re-send
        after a lost confirm (a link cut) meets the key."""
        try:
            headers = to_python(decode_headers(header))
        except ValueError:
            headers = None
        verdict = forwarded(headers, self.server_id)
        # The vhost the link opened here: its exchange's; its keys are that vhost's.
        vhost = self.vhost.vhosts.get(exchange.definition.vhost, self.vhost)
        key = None if verdict.dedup_key is None else scoped(vhost.name, verdict.dedup_key)
        if key is not None:
            self._forward_origins.setdefault(vhost.name, set()).add(key.rpartition("\x00")[0])
        self._load_keys()
        original = 0 if key is None else self._in_flight(key)
        if original:
            # A re-send while its original's batch is in flight (the downstream lost the
            # confirm in a link cut and sends it again on its next session): not published
            # again; its confirm waits for that batch and shares its outcome. Confirmed on a
            # later batch (`confirm_point`), it was acknowledged although the original's
            # write failed: withdrawn here, settled from the downstream's outbox, lost.
            self.forwarded_dropped += 1
            metrics.FORWARDED_DUPLICATES.inc()
            return PublishResult(1, False, original, depends_on=original)
        if verdict.verdict == "loop" or (key is not None and key in self.keys):
            self.forwarded_dropped += 1
            metrics.FORWARDED_DUPLICATES.inc()
            return PublishResult(1, False, self.vhost.committer.confirm_point())
        result = vhost.publish(exchange, routing_key, header, body, info, hold=hold)
        self.forwarded_received += 1
        metrics.FORWARDED_RECEIVED.inc()
        if key is None or result.rejected:
            return result
        self.keys.claim(key)
        ops = self.keys.record(self.vhost, [key])
        batch = self.vhost.committer.add(ops)
        self.vhost.visibility.hold(batch, self.keys.fresh())  # withdrawn if it fails
        outcome = self.batches.wait(batch)
        # The record's batch is the messages' or a later one: the confirm covers both.
        confirm = max(batch, result.batch)
        self._forwards[key] = (confirm, outcome)

        def settled(done: asyncio.Future[bool]) -> None:
            forward = self._forwards.get(key)
            if forward is not None and forward[1] is done:  # not settled by a re-send yet
                self._settle_forward(key)

        outcome.add_done_callback(settled)
        return PublishResult(result.routed, False, confirm, depends_on=result.depends_on)

    def _in_flight(self, key: str) -> int:
        """The batch the confirm of `key`'s forward in flight waits for; 0 if none.

        One whose batch has its outcome is settled now: its future's callback runs a
        loop turn later, and a re-send meanwhile must find the key in the window
        (durable: a duplicate) or released (failed: published again), not still claimed
        (confirmed on whatever is outstanding then, or at once)."""
        forward = self._forwards.get(key)
        if forward is None:
            return 0
        if not forward[1].done():
            return forward[0]
        self._settle_forward(key)
        return 0

    def _settle_forward(self, key: str) -> None:
        """`key`'s forward has its outcome: its key enters the window, or is released."""
        _, done = self._forwards.pop(key)
        ok = not done.cancelled() and done.result()
        self.keys.settle([key] if ok else [], [] if ok else [key])

    def marks_durable(self) -> tuple[int, int]:
        """(the batch covering every journal op so far, the newest batch complete): a
        link's acknowledgements before the first are settled for good once the second
        reaches it (marks.py `ToldMarks.acked`)."""
        return self.vhost.committer.confirm_point(), self.batches.done

    def told_marks(self, vhost: str, queue: str) -> ToldMarks:
        """What this server tells a link consuming `queue` (its link queue) in `vhost`,
        for the point of its stream where nothing is left in the queue (marks.py): of its
        own messages, every ID given so far; of another origin, the lowest mark of its
        links for it (none brings a seq at or below it that it has not republished or
        dropped already). Nothing about an origin downstreams forward here (those come by
        no link), nor, once any has been forwarded, about origins not named."""
        named, others = self.keys.window.tell(vhost)
        forwarded = self._forward_origins.get(vhost, set())
        marks = {
            unscoped_origin(origin): seq for origin, seq in named.items() if origin not in forwarded
        }
        marks.pop(self.server_id, None)  # its own messages are told below
        if forwarded:
            for origin in forwarded:
                marks[unscoped_origin(origin)] = -1
            others = -1
        # A message takes its ID as it enters its queues: every one of this server's up to
        # the last ID given is in the queue already (vhost.py `_enqueue`).
        own = scoped_origin(vhost, self.server_id)
        if own not in forwarded:
            marks[self.server_id] = self.vhost.next_mid - 1
        return ToldMarks(queue=queue, marks=marks, others=max(others, -1))

    def receive_peer_status(
        self,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        *,
        allowed: bool,
        vhost: str = "/",
    ) -> None:
        """Upstream side: a downstream link's status message for this server's `amq.peer`
        (seed 002: a peer's status is published on the other side's exchange). Published
        as it came, never forwarded on; dropped and counted (logged once) when the link's
        user may not write to `amq.peer` or the message is persistent (a status is news,
        never data to keep). `vhost`: the one the link opened here (its `amq.peer`)."""
        target = self.vhost.vhosts.get(vhost, self.vhost)
        exchange = target.exchanges.get(PEER_EXCHANGE)
        why = (
            "the link's user may not write to it" if not allowed
            else "persistent (status messages are transient)" if info.persistent
            else None if exchange is not None
            else "no such exchange"
        )  # fmt: skip
        if why is not None or exchange is None:
            self.peer_status_dropped += 1
            if not self._peer_drop_logged:
                self._peer_drop_logged = True
                log.warning("a federation peer's status for %s dropped: %s", PEER_EXCHANGE, why)
            return
        target.publish(exchange, routing_key, header, body, info, forward=False, admission="news")
        self.peer_status_received += 1

    def _bindings_changed(self, vhost: str, exchange: str) -> None:
        link = self._by_exchange.get((vhost, exchange))
        if link is not None:
            link.bindings_changed()

    def reply_queues(self, routing_key: str, vhost: VirtualHost | None = None) -> list[str]:
        """Where a publish on the default exchange goes when no queue here is named
        `routing_key` and the key is a global key (docs/federation.md, "Global routing
        keys"): with this server's prefix, the temporary queue here it names; naming
        another server's temporary queue (`amq.gen-<server id><sep><token>`, or
        `<server id><sep><name>`), the link queue of that server that holds a binding with
        this key (the requester's queue bound to a federated exchange under it, by hand
        or by `global-keys`), so a service replies as to any RabbitMQ reply-to. One link
        queue at most (the first exchange with the binding): one reply, one copy. In
        `vhost` (default `/`): its queues, its link queues."""
        vhost = self.vhost if vhost is None else vhost
        keys = self.global_keys.get(vhost.name)
        local = None if keys is None else keys.local_queue(routing_key)
        if local is not None:
            return [local]
        key = routing_key.removeprefix(SERVER_NAMED_PREFIX)
        link_queues = self._link_queues.get(vhost.name)
        if link_queues is None:
            # Rebuilt after any definition change: this path is every unroutable
            # default-exchange publish, not worth a scan of every queue each time.
            link_queues = [q for q in vhost.queues if q.startswith(QUEUE_PREFIX)]
            self._link_queues[vhost.name] = link_queues
        if not link_queues:
            return []
        for exchange in vhost.exchanges.values():
            if not exchange.name:
                continue
            prefix = queue_name(exchange.name, "")
            for queue in link_queues:
                if not queue.startswith(prefix):
                    continue
                server = queue[len(prefix) :]
                if (
                    server
                    and server != self.server_id
                    and key.startswith(server)
                    and (queue, routing_key, "[]") in exchange.bindings
                ):
                    return [queue]
        return []

    def _forget_link_queues(self, vhost: str) -> None:
        self._link_queues.pop(vhost, None)

    def peer_refusal(self, peer: str, announced: object) -> str | None:
        """Upstream side: why a connecting peer is refused (its identifier is ours), or None;
        logged, counted and kept for `/status`."""
        refusal = duplicate_refusal(self.server_id, announced, side="downstream")
        if refusal is not None:
            metrics.PEERS_REFUSED.inc()
            self.refused.append(f"{peer}: {refusal}")
            log.error("federation peer %s REFUSED: %s", peer, refusal)
        return refusal

    def peer_event(self, event: peer_status.PeerEventName, address: str, announced: object) -> None:
        """Upstream side: a federation peer's connection here, on `amq.peer`."""
        if isinstance(announced, bytes):
            announced = announced.decode("utf-8", "replace")
        peer_status.publish(
            self.vhost,
            peer_status.PeerEvent(
                event=event,
                server_id=self.server_id,
                peer=announced if isinstance(announced, str) else None,
                address=address,
                time=peer_status.now(),
            ),
        )

    def status(self) -> FederationStatus:
        """The `federation` section of `/status`."""
        links = []
        for link in self.links.values():
            exchange = link.vhost.exchanges.get(link.fed.exchange)
            links.append(
                FederationLinkStatus(
                    exchange=link.fed.exchange,
                    vhost=link.fed.vhost,
                    upstream_vhost=link.upstream_vhost,
                    upstream=link.upstream_name,
                    uri=link.upstream.shown(),
                    upstream_exchange=link.fed.source_exchange,
                    upstream_server_id=link.upstream_id,
                    queue=link.queue,
                    state=link.state,
                    error=link.error,
                    running_since=link.running_since,
                    reconnect_pause=link.reconnect_pause,
                    bindings=len(link.bound),
                    local_bindings=0 if exchange is None else len(exchange.bindings),
                    messages_received=link.received,
                    duplicates_dropped=link.duplicates,
                    loops_dropped=link.loops,
                    messages_held=link.held,
                    dedup_keys=len(link.keys),
                    forward=link.fed.forward,
                    messages_forwarded=link.forwarded,
                    forward_pending=link.forward_pending,
                    forward_loops_dropped=link.forward_loops,
                    upstream_state=_peer_state(link),
                    stale_unbound=link.stale_unbound,
                )
            )
        held = _link_queues_held(self.vhost)
        others = {
            name: found
            for name, vhost in sorted(self.vhost.vhosts.items())
            if name != self.vhost.name and (found := _link_queues_held(vhost))
        }
        return FederationStatus(
            server_id=self.server_id,
            links=links,
            refused_peers=list(self.refused),
            federation_queues=held,
            vhost_federation_queues=others,
            forwarded_received=self.forwarded_received,
            forwarded_dropped=self.forwarded_dropped,
            peer_status_received=self.peer_status_received,
            peer_status_dropped=self.peer_status_dropped,
            global_keys_bound=sum(keys.bound for keys in self.global_keys.values()),
            reply_to_rewritten=sum(keys.rewritten for keys in self.global_keys.values()),
            state=self._state_status(),
            upstream_queues_deleted=list(self.orphans.deleted),
            upstream_queues_pending=[link.shown() for link in self.orphans.pending],
            upstream_queues_left=list(self.orphans.left),
            upstream_queues_found=list(self.orphans.found),
        )

    def _state_status(self) -> StateReplicationStatus:
        exchanges, queues, bindings = self.state.counts()
        return StateReplicationStatus(
            seq=self.state.seq,
            subscribers=self.state.subscribers,
            full_states_sent=self.state.full_states,
            changes_published=self.state.changes,
            exchanges=exchanges,
            queues=queues,
            bindings=bindings,
        )


def _link_queues_held(vhost: VirtualHost) -> dict[str, list[FederationBinding]]:
    """Upstream side: the downstreams' link queues in `vhost` and their bindings."""
    held: dict[str, list[FederationBinding]] = {}
    for queue in vhost.queues:
        if queue.startswith(QUEUE_PREFIX):
            held[queue] = []
    if held:
        for exchange in vhost.exchanges.values():
            if exchange.name == "":
                continue  # every queue's implicit binding
            for binding in exchange.bindings.values():
                if binding.queue in held:
                    held[binding.queue].append(
                        FederationBinding(
                            exchange=exchange.name,
                            routing_key=binding.routing_key,
                            arguments=binding.arguments,
                        )
                    )
    return held


def _peer_state(link: FederationLink) -> PeerStateStatus | None:
    view = link.upstream_state
    if view is None or view.state is None:
        return None
    return PeerStateStatus(
        server_id=view.server_id,
        epoch=view.epoch,
        seq=view.seq,
        exchanges=len(view.state.exchanges),
        queues=len(view.state.queues),
        bindings=len(view.state.bindings),
        link_queue_bindings=sorted(b.routing_key for b in link.held_upstream()),
    )
