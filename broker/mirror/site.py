"""Wiring of the mirror into a broker: the source side, the mirror side, or both.

The broker creates one `Mirroring` from its settings; this module only joins
the parts (`source`, `link`, `applier`, `listener`) to the committer, the
virtual host and the resource monitor, through the narrow Protocols those parts
declare.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from twinmq.broker.alarms import ResourceMonitor
from twinmq.broker.api import MirrorStatus
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.applier import MirrorApplier, MirrorState
from twinmq.broker.mirror.auth import mirror_key
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.mirror.link import MirrorLink
from twinmq.broker.mirror.listener import MirrorListener
from twinmq.broker.mirror.source import MirrorSource, SourceState
from twinmq.broker.settings import BrokerSettings

log = logging.getLogger(__name__)

FLOW_CONTROL_REASON = "mirror-lag"


class Host(SourceState, MirrorState, Protocol):
    """The virtual host as the mirror's two ends use it."""


class Mirroring:
    """The mirror parts a broker runs, per its settings."""

    def __init__(
        self,
        settings: BrokerSettings,
        vhost: Host,
        committer: GroupCommitter,
        monitor: ResourceMonitor,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.source: MirrorSource | None = None
        self.link: MirrorLink | None = None
        self.listener: MirrorListener | None = None
        self.flow_control = False
        token = settings.mirror_token.get_secret_value() if settings.mirror_token else None
        origin = settings.mirror_id or settings.name
        if settings.mirror_to and token is not None:
            self.source = MirrorSource(vhost, committer, clock)
            committer.tap = self.source
            committer.await_durable(self.source)
            self.link = MirrorLink(self.source, settings.mirror_to, mirror_key(token), origin)
            monitor.checks.append(self._flow_control)
            metrics.QUEUE_EVENTS.set_function(lambda: self._source_value("depth"))
            metrics.QUEUE_BYTES.set_function(lambda: self._source_value("depth_bytes"))
            metrics.OLDEST_AGE.set_function(self._oldest_age)
        metrics.ENABLED.set(1 if self.source is not None else 0)
        if settings.mirror_port is not None and token is not None:
            futures = BatchFutures()
            committer.await_durable(futures)
            applier = MirrorApplier(vhost, committer, clock)
            self.listener = MirrorListener(
                applier, futures, mirror_key(token), origin, lambda: not vhost.replica
            )
        self._server: asyncio.Server | None = None

    def _source_value(self, name: str) -> float:
        return float(getattr(self.source, name)) if self.source is not None else 0.0

    def _oldest_age(self) -> float:
        return self.source.oldest_age() if self.source is not None else 0.0

    def _flow_control(self) -> str | None:
        """The flow-control rule: only while the mirror is connected and acknowledging."""
        limit = self.settings.mirror_max_lag
        link, source = self.link, self.source
        if limit <= 0 or link is None or source is None or not link.connected:
            on = False
        else:
            age = source.oldest_age()
            on = age > limit or (self.flow_control and age > limit / 2)
        if on != self.flow_control:
            log.warning("mirror flow control %s", "on: blocking publishers" if on else "off")
            self.flow_control = on
            metrics.FLOW_CONTROL.set(1 if on else 0)
        return FLOW_CONTROL_REASON if on else None

    async def start(self, host: str) -> None:
        """Start the link and the listener (whichever are configured)."""
        if self.source is not None:
            self.source.ensure_active()
        if self.link is not None:
            self.link.start()
        if self.listener is not None and self.settings.mirror_port is not None:
            self._server = await self.listener.start(host, self.settings.mirror_port)

    @property
    def port(self) -> int | None:
        """The bound mirror listener port."""
        if self._server is None:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Close the link and the listener."""
        if self.link is not None:
            await self.link.stop()
        if self._server is not None:
            self._server.close()

    def status(self) -> MirrorStatus:
        """For `/status`."""
        source, link, listener = self.source, self.link, self.listener
        return MirrorStatus(
            enabled=source is not None,
            connected=link is not None and link.connected,
            target=self.settings.mirror_to,
            queue_events=source.depth if source is not None else 0,
            queue_bytes=source.depth_bytes if source is not None else 0,
            oldest_event_age_seconds=self._oldest_age(),
            flow_control=self.flow_control,
            listening=listener is not None,
            sources_connected=listener.connected if listener is not None else 0,
            held_acks=len(listener.applier.holding) if listener is not None else 0,
        )
