"""Federation wired into a broker: its links (downstream side) and its peers (upstream side).

The broker gives it the settings, the virtual host, the committer and its alarm; the
links run only while the broker is active (a pair's passive takes over at promotion).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from pathlib import Path

from twinmq.broker.api import FederationBinding, FederationLinkStatus, FederationStatus
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.federation import metrics
from twinmq.broker.federation.agent import QUEUE_PREFIX, FederationLink
from twinmq.broker.federation.config import FederationConfig
from twinmq.broker.federation.dedup import DurableKeys
from twinmq.broker.federation.identity import duplicate_refusal
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.vhost import VirtualHost

log = logging.getLogger(__name__)

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
    ) -> None:
        self.server_id = server_id
        self.vhost = vhost
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSALS_KEPT)
        self.links: dict[str, FederationLink] = {}
        self.running = False
        self.keys = DurableKeys(1)
        if config is None or not config.exchanges:
            return
        state_dir.mkdir(parents=True, exist_ok=True)
        batches = BatchFutures()
        committer.await_durable(batches)
        # One window for every link: a message arriving by two paths is republished once.
        self.keys = keys = DurableKeys(config.dedup_window)
        for fed in config.exchanges:
            self.links[fed.exchange] = FederationLink(
                fed, fed.upstream, config.upstreams[fed.upstream], server_id, vhost, batches,
                alarm, state_dir, keys,
            )  # fmt: skip
        vhost.binding_listeners.append(self._bindings_changed)

    def start(self) -> None:
        """Declare the local federated exchanges if missing and start the links (active)."""
        if self.running:
            return
        self.running = True
        if self.links:
            # The records replicated or recovered here are the keys (a promoted passive's too).
            self.keys.load(self.vhost)
        for link in self.links.values():
            fed = link.fed
            if fed.exchange not in self.vhost.exchanges:
                self.vhost.declare_exchange(
                    fed.exchange, fed.type, passive=False, durable=True, auto_delete=False,
                    internal=False, arguments={},
                )  # fmt: skip
            link.start()

    async def stop(self) -> None:
        """Stop the links (demotion, shutdown)."""
        self.running = False
        for link in self.links.values():
            await link.stop()

    def _bindings_changed(self, exchange: str) -> None:
        link = self.links.get(exchange)
        if link is not None:
            link.bindings_changed()

    def peer_refusal(self, peer: str, announced: object) -> str | None:
        """Upstream side: why a connecting peer is refused (its identifier is ours), or None;
        logged, counted and kept for `/status`."""
        refusal = duplicate_refusal(self.server_id, announced, side="downstream")
        if refusal is not None:
            metrics.PEERS_REFUSED.inc()
            self.refused.append(f"{peer}: {refusal}")
            log.error("federation peer %s REFUSED: %s", peer, refusal)
        return refusal

    def status(self) -> FederationStatus:
        """The `federation` section of `/status`."""
        links = []
        for link in self.links.values():
            exchange = self.vhost.exchanges.get(link.fed.exchange)
            links.append(
                FederationLinkStatus(
                    exchange=link.fed.exchange,
                    upstream=link.upstream_name,
                    uri=link.upstream.shown(),
                    upstream_exchange=link.fed.source_exchange,
                    upstream_server_id=link.upstream_id,
                    queue=link.queue,
                    state=link.state,
                    error=link.error,
                    running_since=link.running_since,
                    bindings=len(link.bound),
                    local_bindings=0 if exchange is None else len(exchange.bindings),
                    messages_received=link.received,
                    duplicates_dropped=link.duplicates,
                    loops_dropped=link.loops,
                    messages_held=link.held,
                    dedup_keys=len(link.keys),
                )
            )
        held: dict[str, list[FederationBinding]] = {}
        for queue in self.vhost.queues:
            if queue.startswith(QUEUE_PREFIX):
                held[queue] = []
        if held:
            for exchange in self.vhost.exchanges.values():
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
        return FederationStatus(
            server_id=self.server_id,
            links=links,
            refused_peers=list(self.refused),
            federation_queues=held,
        )
