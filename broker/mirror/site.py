"""Wiring of the mirror into a broker: the source side, the mirror side, or both.

The broker creates one `Mirroring` from its settings; this module joins the
parts (`source`, `link`, `applier`, `listener`) to the committer, the virtual
host and the resource monitor, through the narrow Protocols those parts
declare, and holds the site's DR role (`role.py`): which end runs, whether
clients may write, and the controlled switchover (`demote`, `promote`).

A site configured with both ends (`--mirror-to`, `--mirror-port`,
`--mirror-role`) runs one at a time: as `source` its link streams and its
listener refuses; as `replica` its listener applies, its link stays down and
its clients may only read. Applied changes never become events (the source's
tap is off while a replica), so reversing the mirror makes no loop.

As `bidirectional` (`bidi.py`) both ends run at once and clients write: applied
events are passed on with their origin and hop list, never made the site's own.
With several targets (`--mirror-to` repeated) the site is a full-mesh member: one
link per target, each with its own cursor on the one replication queue
(`MirrorSource.cursor`), and nothing forwarded (every site sends its own events
to every other).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from twinmq.broker.alarms import ResourceMonitor
from twinmq.broker.api import (
    DemotionToken,
    MirrorDemoteRequest,
    MirrorLinkState,
    MirrorPromoteRequest,
    MirrorReseed,
    MirrorRpo,
    MirrorStatus,
    MirrorSwitch,
    MirrorTargetStatus,
    MirrorUnmirrored,
)
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.errors import MirrorNotDrained, MirrorRefused
from twinmq.broker.filewatch import reload_every
from twinmq.broker.heap import HEAP
from twinmq.broker.journal import JournalOp, StoredMessage
from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.applier import ORPHANS_NAME, MirrorApplier, MirrorState
from twinmq.broker.mirror.auth import mirror_key
from twinmq.broker.mirror.bidi import IdMap
from twinmq.broker.mirror.delta import LossClaim
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.mirror.events import INTERNAL_QID_BASE, KIND_SNAPSHOT, decode_event
from twinmq.broker.mirror.link import Heartbeat, MirrorLink
from twinmq.broker.mirror.listener import MirrorListener
from twinmq.broker.mirror.role import RoleStore, SiteRole
from twinmq.broker.mirror.source import QUEUE_NAME, MirrorSource, SourceState
from twinmq.broker.settings import BrokerSettings
from twinmq.broker.tls import MutualTls

log = logging.getLogger(__name__)

FLOW_CONTROL_REASON = "mirror-lag"
# Message ids a forced promotion skips: the old source may have handed out ids this site
# never saw (its unmirrored messages); reusing one would make the old source, once
# reversed, keep its own message under the id of one of ours. 2^34 ids: two days at
# 100,000 messages/s; a pair epoch's 2^40 ids leave room for 64 forced promotions.
FORCED_MID_GAP = 1 << 34
SEED_NOT_DURABLE = "its seed for the old source is not durable yet"
# Said instead after a restart, or on the pair's passive once it takes over.
SEED_NOT_DURABLE_HERE = (
    "its seed for the old source was not durable when this broker took over (a restart or "
    "a failover of its pair): queued again"
)


class Host(SourceState, MirrorState, Protocol):
    """The virtual host as the mirror's two ends use it."""

    def set_replica(self, replica: bool) -> None:
        """False: arm the expiry timers of what was applied (a promotion)."""
        ...


class Mirroring:
    """The mirror parts a broker runs, per its settings."""

    def __init__(
        self,
        settings: BrokerSettings,
        vhost: Host,
        committer: GroupCommitter,
        monitor: ResourceMonitor,
        clock: Callable[[], float] = time.time,
        close_clients: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.settings = settings
        self.vhost = vhost
        self.committer = committer
        self.clock = clock
        self.close_clients = close_clients
        self.source: MirrorSource | None = None
        self.link: MirrorLink | None = None  # the one link (not a mesh)
        self.links: list[MirrorLink] = []  # every link: the one, or a mesh's, per target
        self.listener: MirrorListener | None = None
        self.flow_control = False
        self.demoting = False  # a demotion waits for its queue to drain: clients refused
        # Why a forced promotion's seed is still pending, as this process saw it (the record
        # says whether one is: `seed_pending`).
        self._seed_reason: str | None = None
        self._seeding: asyncio.Task[bool] | None = None  # that seed's batch, awaited
        self.beat: Heartbeat | None = None  # the source's last heartbeat (this replica's)
        self.beat_at: float | None = None
        self.seen_epoch = 0  # the highest DR epoch a source announced here
        self._progress = asyncio.Event()  # set as events are acknowledged or applied
        self._switching = asyncio.Lock()  # one switch at a time: a repeat waits, then replays
        token = settings.mirror_token.get_secret_value() if settings.mirror_token else None
        self.origin = origin = settings.mirror_id or settings.name
        first = settings.mirror_first_role
        self.futures = BatchFutures()  # switches and acknowledgements wait on batches
        committer.await_durable(self.futures)
        self.roles = RoleStore(vhost, committer, self.futures, first) if first and token else None
        # The bidirectional mode: one id map, kept by the applier and read by the source.
        self.ids = IdMap(vhost, origin) if first == "bidirectional" else None
        cert, key, ca = settings.mirror_tls_cert, settings.mirror_tls_key, settings.mirror_tls_ca
        # Mutual TLS on the link, both ends, one identity (the files reloaded together).
        self.tls = MutualTls(cert, key, ca) if cert and key and ca else None
        self._reload: asyncio.Task[None] | None = None
        if settings.mirror_to and token is not None and self.roles is not None:
            self.source = MirrorSource(vhost, committer, clock)
            self.source.sending = lambda: self.is_source
            self.source.retention = settings.mirror_retention_events
            self.source.needs_resync = self.roles.current.needs_resync
            self.source.on_needs_resync = self._needs_resync
            self.source.on_acked = self.progressed
            self.source.ids = self.ids
            self.source.name = origin
            self.source.heap = HEAP  # both ends hold every message long-lived
            committer.tap = self.source
            committer.await_durable(self.source)
            mesh = settings.mirror_mesh
            if mesh:
                self.source.targets = settings.mirror_targets
            for address in settings.mirror_targets:
                target = address if mesh else None
                self.links.append(MirrorLink(
                    self.source,
                    address,
                    mirror_key(token),
                    origin,
                    epoch=lambda: self.epoch,
                    on_fenced=self._fenced,
                    expected_peer=lambda: self.roles.current.took_over_from if self.roles else None,
                    on_gap=self._on_gap(target),
                    tls=self.tls,
                    server_name=settings.mirror_tls_server_name,
                    marks=self._applied_marks,
                    target=target,
                ))  # fmt: skip
            self.link = None if mesh else self.links[0]
            # Checked only while no disk or memory alarm is raised: the seed's retry.
            monitor.checks.append(self._seed_again)
            monitor.checks.append(self._flow_control)
            metrics.QUEUE_EVENTS.set_function(lambda: self._source_value("depth"))
            metrics.QUEUE_BYTES.set_function(lambda: self._source_value("depth_bytes"))
            metrics.OLDEST_AGE.set_function(self._oldest_age)
        metrics.ENABLED.set(1 if self.source is not None else 0)
        if settings.mirror_port is not None and token is not None:
            forwarder = self.source if self.ids is not None else None
            applier = MirrorApplier(vhost, committer, clock, ids=self.ids, forwarder=forwarder)
            applier.heap = HEAP
            self.listener = MirrorListener(
                applier, self.futures, mirror_key(token), origin, self, tls=self.tls
            )
        self._server: asyncio.Server | None = None
        self.monitor = monitor
        self._metrics()

    # -- the role ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """This site's DR epoch (0 without a mirror)."""
        return self.roles.epoch if self.roles is not None else 0

    @property
    def is_source(self) -> bool:
        """Whether this site is the DR source (writable; a bidirectional site is one)."""
        return self.roles is not None and self.roles.role in ("source", "bidirectional")

    def write_refusal(self) -> str | None:
        """Why clients may not publish or change the mirrored topology here, or None."""
        if self.roles is None:
            return None
        name = self.settings.name
        if (refusal := self.client_refusal()) is not None:
            return refusal
        if self.demoting:
            return f"{name} is being demoted (DR switchover): publish to the promoted site"
        if self.roles.role == "replica":
            return (
                f"{name} is a DR mirror (replica) at DR epoch {self.epoch}: publish to the "
                f"source site"
            )
        return None

    @property
    def seed_pending(self) -> str | None:
        """Why a forced promotion's seed for the old source is not durable yet, or None.
        Clients are refused until it is: what they settled meanwhile would be orphans
        there. Kept in the role record, so a restart (or the pair's passive, taking over)
        keeps refusing until a seed is durable (`_seed_again` queues one)."""
        pending = self.roles.current.seed_pending if self.roles is not None else None
        if pending is None:
            return None
        return self._seed_reason or pending

    def _seed_settled(self) -> None:
        """No seed is pending any more (durable, or this site is no source): cleared in the
        record (its batch the next; a restart before it seeds once more, harmlessly:
        clients were refused, the state is the seed's)."""
        self._seed_reason = None
        roles = self.roles
        if roles is not None and roles.current.seed_pending is not None:
            roles.record(roles.current.model_copy(update={"seed_pending": None}))

    def client_refusal(self) -> str | None:
        """Why clients may not connect at all here now (a forced promotion's seed is not
        durable), or None. Every client is refused, not only its writes: acks, no-ack
        deliveries, rejects to a dead-letter exchange and transactions all settle."""
        if self.seed_pending is None or not self.is_source:
            return None
        name = self.settings.name
        return f"{name} is the DR source but not serving clients yet: {self.seed_pending}"

    async def _save(self, record: SiteRole) -> None:
        """Make `record` the role, durable (and on the pair's passive) before returning."""
        assert self.roles is not None
        ok = await self.roles.save(record)
        self._metrics()
        if not ok:
            raise MirrorRefused("the journal refused the role record: the switch is not durable")

    def _metrics(self) -> None:
        metrics.ROLE.set(1 if self.is_source else 0)
        metrics.EPOCH.set(self.epoch)
        needs_resync = self.source is not None and self.source.needs_resync is not None
        metrics.NEEDS_RESYNC.set(1 if needs_resync else 0)

    def _fenced(self, epoch: int, reason: str) -> None:
        """The link met a site at a higher DR epoch: stop taking writes at once."""
        if self.roles is None or epoch <= self.roles.epoch:
            return
        was = self.roles.role
        log.error("mirror: fenced by DR epoch %d (this site had %d, %s): %s; now a replica",
                  epoch, self.roles.epoch, was, reason)  # fmt: skip
        # In effect at once (in memory); durable with the batch it joins.
        # A replica seeds nothing (a later promotion: its own).
        update = {"role": "replica", "epoch": epoch, "fenced_by": reason, "seed_pending": None}
        self.roles.record(self.roles.current.model_copy(update=update))
        self._seed_reason = None
        self._metrics()
        if was == "source":
            self.close_clients(f"{self.settings.name} was fenced by a site at DR epoch {epoch}")

    def took_over(self) -> None:
        """This broker became its pair's active: the source's NeedsResync is the role
        record's, replicated in the batch of the drop it describes (its memory is the one
        it started with as a passive: without this, a passive promoted after a drop
        resumed the mirror from its mark, past the dropped events)."""
        if self.source is not None and self.roles is not None:
            self.source.needs_resync = self.roles.current.needs_resync
            self._metrics()

    def _needs_resync(self, reason: str) -> tuple[list[JournalOp], Callable[[], list[JournalOp]]]:
        """Called as a batch closes (the committer's tap), which dropped the backlog: the
        role record keeping NeedsResync, as ops of that same batch (a `kill -9` between
        a drop and its record left a promoted passive resuming the mirror past the
        dropped events), and what undoes it should the batch fail."""
        roles = self.roles
        assert roles is not None
        ops, undo = roles.replace(roles.current.model_copy(update={"needs_resync": reason}))
        self._metrics()

        def undone() -> list[JournalOp]:
            restored = undo()
            self._metrics()
            return restored

        return ops, undone

    # -- re-seeding -------------------------------------------------------------------------

    async def reseed(self) -> MirrorReseed:
        """`POST /mirror/reseed`: rebuild the mirror from a new seed (leaves NeedsResync).

        Only the DR source's active broker seeds. What the mirror then holds and the
        source does not goes to its orphan queue (docs/mirror.md, "Re-seed and orphans").
        """
        async with self._switching:
            roles, source = self.roles, self.source
            name = self.settings.name
            if roles is None or source is None:
                raise MirrorRefused(f"{name} is not a DR mirror source (--mirror-to)")
            mesh = self.settings.mirror_mesh and roles.role == "bidirectional"
            if roles.role != "source" and not mesh:
                raise MirrorRefused(f"{name} is a DR replica: seed from the source site")
            if self.vhost.replica:
                raise MirrorRefused(f"{name} is passive: call the source's active broker")
            reason = "requested (POST /mirror/reseed)"
            if source.needs_resync is not None:
                reason += f" after NeedsResync: {source.needs_resync}"
            messages, batch = self._reseed_now(reason)
            if not await self.futures.wait(batch):
                raise MirrorRefused("the journal refused the seed: call again")
            return MirrorReseed(messages=messages, events=source.depth, reason=reason)

    def _on_gap(self, target: str | None) -> Callable[[str], object]:
        """A link's gap handler: a seed for its target (a mesh), or for the one mirror."""

        def gap(reason: str) -> object:
            return self._reseed_now(reason, target)

        return gap

    def _reseed_now(self, reason: str, target: str | None = None) -> tuple[int, int]:
        """Queue a seed now (the link's gap, or a request); (messages, its batch). A mesh:
        for `target` (a gap) and the targets in NeedsResync only."""
        roles, source = self.roles, self.source
        assert roles is not None and source is not None
        log.warning("mirror: seeding the mirror again: %s", reason)
        update = {"needs_resync": None, "took_over_from": None}
        batch, undo = roles.record_undoable(roles.current.model_copy(update=update))
        # Undone if the seed's batch fails: a passive promoted then must still know the
        # mirror needs a seed (NeedsResync), or it resumes the mirror from its mark.
        source.undo_if_failed(batch, undo)
        messages = source.reseed(reason, target)
        self._metrics()
        batch = self.committer.flush_now()
        if self.seed_pending is not None and target is None and self._seeding is None:
            # Any whole seed clears a forced promotion's pending one (a retry, the link's).
            self._watch_seed(batch)
        return messages, batch

    def _watch_seed(self, batch: int) -> asyncio.Task[bool]:
        """Follow a seed's `batch` for a forced promotion whose seed is pending."""
        self._seeding = asyncio.get_running_loop().create_task(
            self._until_seed_durable(batch), name="twinmq-mirror-forced-seed"
        )
        return self._seeding

    async def _until_seed_durable(self, batch: int) -> bool:
        """Wait for a forced promotion's seed; take clients again once it is durable."""
        try:
            durable = await self.futures.wait(batch)
        finally:
            self._seeding = None
        if durable:
            log.warning("mirror: the forced promotion's seed is durable: clients taken again")
            self._seed_settled()
        else:
            self._seed_reason = (
                "the journal refused its seed for the old source (disk full?): queued again "
                "once the disk alarm clears"
            )
            log.error("mirror: %s; clients refused until then", self.seed_pending)
            self.close_clients(f"{self.settings.name}: {self.seed_pending}")
        return durable

    def _seed_due(self) -> bool:
        """A forced promotion's seed failed and none is under way: it is to be queued."""
        return (
            self.seed_pending is not None
            and self._seeding is None
            and self.is_source
            and not self.vhost.replica  # only the active broker seeds
            # A forced promotion queues its own once its record is durable (the record
            # says "pending" from the start): never a second one from here meanwhile.
            and not self._switching.locked()
        )

    def _seed_again(self) -> str | None:
        """A resource check (run only without a disk or memory alarm): queue the forced
        promotion's seed again if it failed. Never an alarm itself."""
        if self._seed_due():
            # Not from inside the monitor's check: the seed closes a batch of its own.
            asyncio.get_running_loop().call_soon(self._seed_now_if_pending)
        return None

    def _seed_now_if_pending(self) -> None:
        if not self._seed_due():  # again: the turn since may have seeded or demoted
            return
        if self._seed_reason is None:
            # Pending in the record, never tried by this process: it restarted, or took
            # over from its pair's active, before the seed was durable.
            self._seed_reason = SEED_NOT_DURABLE_HERE
            log.error("mirror: the forced promotion's %s; clients refused until it is durable",
                      SEED_NOT_DURABLE_HERE.removeprefix("its "))  # fmt: skip
            self._reseed_now("the forced promotion's seed again: pending when this broker "
                             "took over")  # fmt: skip
            return
        self._reseed_now("the forced promotion's seed again: the disk has room")

    # -- the listener's site ----------------------------------------------------------------

    def link_refusal(self, origin: str, epoch: int) -> tuple[str, int] | None:
        """Why a source at DR `epoch` may not stream here now, with this site's epoch."""
        name, own = self.settings.name, self.epoch
        if self.vhost.replica:
            return f"{name} is passive: link to the mirror's active broker", own
        if self.roles is None or self.roles.role == "source":
            return f"{name} is the DR source at epoch {own}: it takes no mirror link", own
        if epoch < own:
            return f"source {origin} at DR epoch {epoch} is fenced: {name} is at {own}", own
        self.seen_epoch = max(self.seen_epoch, epoch)
        return None

    def blocked(self) -> str | None:
        """This broker's disk or memory alarm while raised (the listener then applies
        nothing: applying would write and grow)."""
        reason = self.monitor.reason
        return reason if reason in ("disk", "memory") else None

    def heard(self, origin: str, beat: Heartbeat) -> None:
        """A source's heartbeat: what a forced promotion would report as its RPO."""
        self.beat, self.beat_at = beat, self.clock()
        self.seen_epoch = max(self.seen_epoch, beat.epoch)

    def _applied_marks(self) -> dict[str, int]:
        """How far this site applied each origin it mirrored (told to the site it mirrors
        to when they compare a seed: an old source counts what never reached this one)."""
        listener = self.listener
        if listener is None or self.ids is not None:
            return {}
        applier = listener.applier
        return {origin: applier.applied(origin) for origin in applier.origins()}

    def marks_seen(self, origin: str, marks: dict[str, int]) -> LossClaim | str | None:
        """The site that fenced this one says it applied its events up to
        `marks[self.origin]`. Checked against what this site made: a mark above its newest
        event is a lie (refused: the link is closed, nothing counted, nothing dropped); up
        to it, the events it claims are to be verified against the comparison's probes
        (the claim, settled by `settle_loss` once the comparison is complete)."""
        roles, mark = self.roles, marks.get(self.origin)
        if roles is None or mark is None or roles.current.fenced_by is None:
            return None  # a switchover drained everything: nothing to count
        done = roles.current.unmirrored
        if done is not None and done.promoted == origin and done.epoch == roles.current.epoch:
            return None  # counted (and dropped) at an earlier session already
        queue = self.vhost.queues.get(QUEUE_NAME)
        if queue is None or not queue.entries:
            return None  # nothing left to count or drop
        newest = queue.entries[-1].message.mid
        if mark > newest:
            why = (f"{origin} says it applied {self.origin}'s events up to {mark}, but "
                   f"{self.settings.name} made none after {newest}: refused, its backlog "
                   f"of {len(queue.entries)} events kept")  # fmt: skip
            log.error("mirror: %s", why)
            return why
        claimed: list[tuple[int, list[JournalOp]]] = []
        for entry in queue.entries:
            if entry.message.mid > mark:
                break
            claimed.append((entry.message.mid, _user_ops(entry.message.mid, entry.message.body)))
        return LossClaim(mark, claimed)

    def settle_loss(self, origin: str, claim: LossClaim) -> None:
        """The comparison is complete: count this site's events after the mark (the
        forced failover's RPO, as a count), keep the count, and drop (in one batch,
        `MirrorSource.drop_unsent`) those and the claimed events whose messages the
        probes showed held there; a claimed event with a message not shown stays in the
        backlog, counted as unverified."""
        roles, mark = self.roles, claim.mark
        queue = self.vhost.queues.get(QUEUE_NAME)
        if roles is None or queue is None or not queue.entries:
            return
        keep, unverified = claim.unverified()
        events = messages = settles = 0
        for entry in queue.entries:
            if entry.message.mid <= mark:
                continue
            events += 1
            if entry.message.body[:1] == bytes([KIND_SNAPSHOT]):
                # A seed restates what this site held (mostly mirrored from the other
                # site, which holds it): no client confirmed it here after the mark.
                # What of it the other site lacks shows as this site's orphans.
                continue
            for op in _user_ops(entry.message.mid, entry.message.body):
                if type(op) is StoredMessage:
                    messages += 1
                else:
                    settles += 1
        counted = MirrorUnmirrored(
            promoted=origin, applied_seq=mark, events=events, messages=messages,
            settles=settles, counted_at=self.clock(), unverified_events=len(keep),
            unverified_messages=unverified, epoch=roles.current.epoch,
        )  # fmt: skip
        log.error("mirror: forced failover to %s: %d events of this site (%d messages, %d "
                  "settles) after its event %d were never applied there", origin, events,
                  messages, settles, mark)  # fmt: skip
        if keep:
            log.error("mirror: %s says it applied this site's events up to %d; %d of them "
                      "carry %d messages its seed does not show: those events are kept in "
                      "the backlog, not dropped", origin, mark, len(keep), unverified)  # fmt: skip
        roles.record(roles.current.model_copy(update={"unmirrored": counted}))
        if self.source is not None:
            self.source.drop_unsent(keep)

    def progressed(self) -> None:
        """Events were acknowledged (source) or applied (replica): wake a waiting switch."""
        self._progress.set()

    async def _until(self, done: Callable[[], bool]) -> None:
        """Wait until `done()`, looking again at every progress (the caller bounds it)."""
        while not done():
            self._progress.clear()
            await self._progress.wait()

    # -- the switchover ---------------------------------------------------------------------

    async def demote(self, request: MirrorDemoteRequest) -> MirrorSwitch:
        """The source's half of a switchover: refuse clients, drain, hand over a token.

        Replay-safe: a demoted site answers a repeated request with its token; a
        demotion that timed out stays fenced and finishes on the next call.
        """
        async with self._switching:
            return await self._demote(request)

    async def promote(self, request: MirrorPromoteRequest) -> MirrorSwitch:
        """The replica's half: with a token, once applied up to it (no loss); with
        `force`, at once, reporting what may be lost (RPO). Replay-safe."""
        async with self._switching:
            return await self._promote(request)

    async def _demote(self, request: MirrorDemoteRequest) -> MirrorSwitch:
        roles, source = self.roles, self.source
        self._no_switch_when_bidirectional()
        if roles is None or source is None or self.link is None:
            raise MirrorRefused(f"{self.settings.name} is not a DR mirror source (--mirror-to)")
        if roles.role == "replica":
            last = roles.current.last_switch
            if last is not None and last.token is not None and last.epoch == roles.epoch:
                return last
            raise MirrorRefused(f"{self.settings.name} is a replica: nothing to demote")
        if source.needs_resync is not None:
            raise MirrorRefused(f"the mirror cannot take over: {source.needs_resync}")
        started = time.monotonic()
        if not self.demoting:
            self.demoting = True
            log.warning("mirror: demoting %s: clients refused, draining", self.settings.name)
            self.close_clients(f"{self.settings.name} is being demoted (DR switchover)")
        self.committer.flush_now()  # the last client ops' event joins the queue now
        try:
            async with asyncio.timeout(request.timeout):
                await self._until(lambda: source.depth == 0)
        except TimeoutError:
            raise MirrorNotDrained(
                f"{source.depth} events not acknowledged by the mirror after "
                f"{request.timeout} s (link {self.link_state()}); still fenced: call again"
            ) from None
        epoch = roles.epoch + 1
        token = DemotionToken(origin=self.origin, seq=source.acked_seq, epoch=epoch)
        switch = MirrorSwitch(
            role="replica", epoch=epoch, token=token, seconds=time.monotonic() - started
        )
        update = {
            "role": "replica", "epoch": epoch, "last_switch": switch, "fenced_by": None,
            "seed_pending": None,
        }  # fmt: skip
        await self._save(roles.current.model_copy(update=update))
        self.demoting = False
        self._seed_reason = None
        log.warning("mirror: demoted at DR epoch %d: %s", epoch, token.model_dump_json())
        return switch

    def _no_switch_when_bidirectional(self) -> None:
        if self.ids is not None:
            raise MirrorRefused(f"{self.settings.name} is a bidirectional site: every site "
                                f"is writable, there is nothing to switch over")  # fmt: skip

    async def _promote(self, request: MirrorPromoteRequest) -> MirrorSwitch:
        roles, listener = self.roles, self.listener
        self._no_switch_when_bidirectional()
        if roles is None or listener is None:
            raise MirrorRefused(f"{self.settings.name} is not a DR mirror (--mirror-port)")
        token = request.token
        if roles.role == "source":
            last = roles.current.last_switch
            if (
                last is not None
                and last.role == "source"
                and ((token is not None and last.token == token) or (token is None and last.forced))
            ):
                return last.model_copy(update={"seed_pending": self.seed_pending})
            raise MirrorRefused(f"{self.settings.name} is the DR source already")
        if self.vhost.replica:
            raise MirrorRefused(f"{self.settings.name} is passive: promote the active broker")
        started = time.monotonic()
        applier = listener.applier
        rpo: MirrorRpo | None = None
        if token is not None:
            if token.epoch <= roles.epoch:
                raise MirrorRefused(f"stale token: epoch {token.epoch}, this site is at "
                                    f"{roles.epoch}")  # fmt: skip
            others = [o for o in applier.origins() if o != token.origin]
            if others:
                raise MirrorRefused(f"this site mirrors {others[0]!r}, not {token.origin!r}")
            try:
                async with asyncio.timeout(request.timeout):
                    await self._until(lambda: applier.applied(token.origin) >= token.seq)
            except TimeoutError:
                raise MirrorRefused(
                    f"not applied up to the token: event {applier.applied(token.origin)} of "
                    f"{token.seq}; the source is not drained here"
                ) from None
            epoch = token.epoch
        elif request.force:
            epoch = max(roles.epoch, self.seen_epoch) + 1
            rpo = self._rpo_now(listener)
            # Before the role record, which takes the next id: its id carries the skip to
            # the pair's passive and through a restart (recovery resumes above it).
            self.vhost.next_mid += FORCED_MID_GAP
        else:
            raise MirrorRefused("promote needs the source's demotion token, or force")
        for writer in list(listener.sessions.values()):
            writer.close()  # apply nothing more from the old source
        switch = MirrorSwitch(
            role="source", epoch=epoch, token=token, forced=token is None, rpo=rpo,
            seconds=time.monotonic() - started,
        )  # fmt: skip
        took_over_from = token.origin if token is not None else None
        # Forced: its seed is pending from the record on (durable before any client of a
        # restarted site, or of the pair's passive taking over, could settle a message).
        seeding = token is None and self.source is not None
        self._seed_reason = None
        await self._save(roles.current.model_copy(update={
            "role": "source", "epoch": epoch, "last_switch": switch, "fenced_by": None,
            "rpo": rpo if rpo is not None else roles.current.rpo,
            "took_over_from": took_over_from,
            "seed_pending": SEED_NOT_DURABLE if seeding else None}))  # fmt: skip
        self.vhost.set_replica(False)  # applied messages get their expiry timers
        if self.source is not None and token is not None:
            # Failback needs no snapshot: the demoted site holds every message here.
            self.source.activate(snapshot=False)
        elif self.source is not None:
            # Forced: the old source holds what never came here. A seed (compared as a
            # delta: cheap) rebuilds it and carries the marks its loss count rides on,
            # also when this site was a source before (its queue exists: its activation
            # would seed nothing). Now, in this turn of the loop, before any client of
            # this site settles a message: it holds exactly what was applied from the old
            # source. Taken later (the link's next try, the first client batch), a
            # message consumed here meanwhile was missing from it, and the old source kept
            # it as an orphan beside those it alone had: re-published, delivered twice.
            # Clients wait for it to be durable: a refused one (a full disk) is withdrawn.
            self.source.seed_forced(f"forced promotion at DR epoch {epoch}")
            # Durable, and on the pair's passive, before the answer: a failover of this
            # pair right after it sends the same seed (a passive that finds the queue
            # there would not make one).
            await asyncio.shield(self._watch_seed(self.committer.flush_now()))
            switch = switch.model_copy(update={"seed_pending": self.seed_pending})
        if rpo is not None:
            log.error("mirror: FORCED promotion at DR epoch %d; RPO: %s", epoch,
                      rpo.model_dump_json())  # fmt: skip
        elif token is not None:
            log.warning("mirror: promoted at DR epoch %d, token %s", epoch, token.model_dump_json())
        return switch

    def _rpo_now(self, listener: MirrorListener) -> MirrorRpo:
        """What a forced promotion would report now: applied here, and the source as last
        heard."""
        origins = listener.applier.origins()
        beat = self.beat
        return MirrorRpo(
            last_applied_seq=listener.applier.applied(origins[0]) if origins else 0,
            source_last_seq_seen=beat.head if beat is not None else 0,
            source_unreplicated_seen=beat.backlog if beat is not None else 0,
            seen_at=self.beat_at,
        )

    def link_state(self, link: MirrorLink | None = None) -> MirrorLinkState:
        """The source link's state, honestly (a mesh: the worst of its targets', or
        `link`'s)."""
        if self.roles is not None and self.roles.current.fenced_by is not None:
            return "fenced"
        if self.source is None or not self.links or not self.is_source:
            return "disabled"
        if self.source.needs_resync is not None:
            return "needs-resync"
        links = self.links if link is None else [link]
        if any(each.target in self.source.target_resync for each in links):
            return "needs-resync"
        return "connected" if all(each.connected for each in links) else "connecting"

    def _target_status(self, link: MirrorLink) -> MirrorTargetStatus:
        """One mesh target, for `/status` (refreshes its gauges)."""
        source, target = self.source, link.target
        assert source is not None and target is not None
        status = MirrorTargetStatus(
            target=target,
            peer=link.peer or source.target_peers.get(target),
            state=self.link_state(link),
            connected=link.connected,
            acked_seq=source.cursor(target),
            queue_events=source.backlog(target),
            queue_bytes=source.backlog_bytes(target),
            oldest_event_age_seconds=round(source.target_oldest_age(target), 3),
            round_trip_seconds=link.round_trip,
            link_error=link.last_error,
            mirror_blocked=link.mirror_blocked,
            needs_resync=source.target_resync.get(target),
        )
        metrics.TARGET_QUEUE_EVENTS.labels(target).set(status.queue_events)
        metrics.TARGET_OLDEST_AGE.labels(target).set(status.oldest_event_age_seconds)
        metrics.TARGET_NEEDS_RESYNC.labels(target).set(1 if status.needs_resync else 0)
        return status

    def _source_value(self, name: str) -> float:
        return float(getattr(self.source, name)) if self.source is not None else 0.0

    def _oldest_age(self) -> float:
        return self.source.oldest_age() if self.source is not None else 0.0

    def _flow_control(self) -> str | None:
        """The flow-control rule: only while the mirror is connected and acknowledging."""
        limit = self.settings.mirror_max_lag
        link, source = self.link, self.source
        if limit > 0 and source is not None and source.targets:
            # A mesh: only the targets connected and consuming count; one down (its
            # backlog growing) never slows producers.
            ages = [
                source.target_oldest_age(each.target)
                for each in self.links
                if each.target is not None and each.connected and each.mirror_blocked is None
            ]
            age = max(ages, default=0.0)
            on = bool(ages) and (age > limit or (self.flow_control and age > limit / 2))
        elif limit <= 0 or link is None or source is None or not link.connected:
            on = False
        elif link.mirror_blocked is not None:
            on = False  # the mirror is not consuming (its alarm): producers are not slowed
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
        if self.tls is not None and (self.link is not None or self.listener is not None):
            # A renewed certificate serves new handshakes; the running link keeps its own.
            self._reload = asyncio.get_running_loop().create_task(
                reload_every(self.tls.reload_if_changed), name="twinmq-mirror-tls-reload"
            )
        for link in self.links:
            link.start()
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
        if self._reload is not None:
            self._reload.cancel()
        for link in self.links:
            await link.stop()
        if self._server is not None:
            self._server.close()

    def status(self) -> MirrorStatus:
        """For `/status` (refreshes the per-queue lag gauges)."""
        source, link, listener = self.source, self.link, self.listener
        lag = source.lag_by_queue() if source is not None else {}
        lag_seconds = source.lag_seconds_by_queue() if source is not None else {}
        lag_bytes = source.lag_bytes_by_queue() if source is not None else {}
        metrics.QUEUE_LAG.clear()
        metrics.QUEUE_LAG_SECONDS.clear()
        metrics.QUEUE_LAG_BYTES.clear()
        for name, size in lag_bytes.items():
            metrics.QUEUE_LAG_BYTES.labels(name).set(size)
        for name, events in lag.items():
            metrics.QUEUE_LAG.labels(name).set(events)
        for name, seconds in lag_seconds.items():
            metrics.QUEUE_LAG_SECONDS.labels(name).set(seconds)
        if link is not None and link.round_trip is not None:
            metrics.ROUND_TRIP.set(link.round_trip)
        targets = [self._target_status(each) for each in self.links if each.target is not None]
        mesh_error = next((f"{t.target}: {t.link_error}" for t in targets if t.link_error), None)
        if targets:
            metrics.CONNECTED.set(1 if all(t.connected for t in targets) else 0)
        roles = self.roles
        orphans = self.vhost.queues.get(ORPHANS_NAME)
        return MirrorStatus(
            enabled=source is not None and self.is_source,
            role=roles.role if roles is not None else None,
            epoch=self.epoch,
            state=self.link_state(),
            connected=(link is not None and link.connected)
            or (bool(targets) and all(t.connected for t in targets)),
            heartbeat_age_seconds=link.heartbeat_age() if link is not None else None,
            round_trip_seconds=link.round_trip if link is not None else None,
            link_error=link.last_error if link is not None else mesh_error,
            mirror_blocked=link.mirror_blocked if link is not None else None,
            queue_lag_events=lag,
            queue_lag_seconds=lag_seconds,
            queue_lag_bytes=lag_bytes,
            needs_resync=source.needs_resync if source is not None else None,
            last_seed=source.last_seed if source is not None else None,
            seed_pending=self.seed_pending if self.is_source else None,
            orphans=orphans.message_count if orphans is not None else 0,
            rpo=roles.current.rpo if roles is not None else None,
            failover_rpo=(
                self._rpo_now(listener)
                if listener is not None and roles is not None and roles.role == "replica"
                else None
            ),
            unmirrored=roles.current.unmirrored if roles is not None else None,
            target=self.settings.mirror_to,
            mesh=bool(targets),
            targets=targets,
            queue_events=source.depth if source is not None else 0,
            queue_bytes=source.depth_bytes if source is not None else 0,
            oldest_event_age_seconds=self._oldest_age(),
            flow_control=self.flow_control,
            listening=listener is not None,
            sources_connected=listener.connected if listener is not None else 0,
            held_acks=len(listener.applier.holding) if listener is not None else 0,
            tls=self.tls is not None,
        )


def _user_ops(seq: int, body: bytes) -> list[JournalOp]:
    """An event's ops on clients' queues (none for a malformed or topology event)."""
    try:
        ops = decode_event(seq, body).ops or []
    except ValueError:
        return []
    return [op for op in ops if op.qid < INTERNAL_QID_BASE]
