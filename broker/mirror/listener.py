"""The mirror's end of the link: authenticate a source, apply its events, acknowledge.

One session per origin: a newer authenticated session of the same origin (the
source pair failed over, or reconnected before the old TCP connection died)
replaces the older one. Events read together are applied together
(`MirrorApplier.apply`, one group commit); the ACK of their last seq is written
once that batch is complete, in order, while the next events are being applied.
Only an active broker of a replica site accepts a source (`ListenerSite.link_refusal`:
a passive of the mirror pair, a promoted site, a source at an older DR epoch are
refused, the REFUSE carrying this site's epoch). A source whose proof holds is
refused only after this side's WELCOME proved it too: a REFUSE that can fence
the source (a higher epoch) never comes from an unauthenticated peer. Heartbeats (`link.Heartbeat`)
are echoed as received and reported to the site (`heard`): the RPO a forced
promotion reports. Before its first event a source may compare a pending seed with
what this mirror holds (RECONCILE, `delta.py`): answered from the queues as they are,
in slices of work with turns of the loop between them; a RECONCILE beyond the bounds
of `delta.refusal`, or after the session's first event, is refused (REFUSE with the
reason, the link closed, `twinmq_mirror_reconcile_refused_total`). The marks its first
RECONCILE carries are checked by the site (`marks_seen`): a forged one is refused the
same way; a plausible one is verified against the comparison's probes and settled at
the session's first event (`settle_loss`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass, field
from typing import Protocol

from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.applier import MirrorApplier
from twinmq.broker.mirror.auth import Transcript
from twinmq.broker.mirror.delta import (
    RECONCILE_VERSION,
    LossClaim,
    RangeAnswer,
    ReconcileReply,
    answering,
    refusal,
    wire,
)
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.mirror.link import Heartbeat, MirrorBeat, decode_heartbeat
from twinmq.broker.replication.handshake import new_nonce
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import (
    Challenge,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    Welcome,
    decode_batch,
    decode_model,
    encode,
    encode_u64,
)
from twinmq.broker.tasks import cancel_and_wait
from twinmq.broker.tls import MutualTls, certificate_names, report_refused_handshakes

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
# Shorter than a source's handshake deadline (link.py): a plaintext source, which waits
# for a CHALLENGE as this side waits for a TLS hello, is closed here first (and says so).
TLS_HANDSHAKE_TIMEOUT = 5.0
SILENCE = 15.0
MAX_APPLY_EVENTS = 4096  # events applied in one group commit, at most
BLOCKED_POLL = 0.5  # seconds between looks at a raised resource alarm


class ListenerSite(Protocol):
    """The mirror site as its listener asks it."""

    def link_refusal(self, origin: str, epoch: int) -> tuple[str, int] | None:
        """Why a source at DR `epoch` is refused now, with this site's epoch; or None."""
        ...

    def heard(self, origin: str, beat: Heartbeat) -> None:
        """A source's heartbeat arrived."""
        ...

    def progressed(self) -> None:
        """Events were applied (a promotion may be waiting for them)."""
        ...

    def blocked(self) -> str | None:
        """This broker's resource alarm (disk, memory) while it is raised, else None."""
        ...

    def marks_seen(self, origin: str, marks: dict[str, int]) -> LossClaim | str | None:
        """A source said how far it applied each origin it mirrored (this one's, if this
        site was its source before a forced failover: what never reached it). A claim to
        verify against the comparison, why the marks are refused (a lie), or None."""
        ...

    def settle_loss(self, origin: str, claim: LossClaim) -> None:
        """The comparison is complete: count and drop what `claim` allows."""
        ...


class ReconcileRefused(ProtocolError):
    """A source's RECONCILE is refused (its reason is said to the source)."""


@dataclass(slots=True)
class _Session:
    """What one source session's comparison keeps between its RECONCILE frames."""

    held: dict[int, list[int]] = field(default_factory=dict)  # qid -> sorted ids
    claim: LossClaim | None = None
    compared: bool = False  # an event arrived: no comparison any more


def _refused(exc: ssl.SSLError) -> None:
    metrics.REFUSED.labels("certificate").inc()
    log.warning("mirror: a source failed the TLS handshake: %s: closed", exc)


class MirrorListener:
    """Accepts mirror links from sources and feeds their events to the applier."""

    def __init__(
        self,
        applier: MirrorApplier,
        futures: BatchFutures,
        key: str,
        name: str,
        site: ListenerSite,
        tls: MutualTls | None = None,
    ) -> None:
        self.applier = applier
        self.tls = tls  # mutual TLS: this site's certificate, the sources' CAs
        self.futures = futures
        self.key = key
        self.name = name
        self.site = site
        self.sessions: dict[str, asyncio.StreamWriter] = {}
        self.epochs: dict[str, int] = {}  # origin -> DR epoch its HELLO announced

    async def start(self, host: str, port: int) -> asyncio.Server:
        """Listen for sources (over mutual TLS with --mirror-tls-*: a source that dials
        plaintext, which waits for a CHALLENGE, is closed at the handshake's deadline)."""
        if self.tls is None:
            return await asyncio.start_server(self._handle, host, port, reuse_address=True)
        report_refused_handshakes(self.tls.context, _refused)
        return await asyncio.start_server(
            self._handle, host, port, reuse_address=True,
            ssl=self.tls.context, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT,
        )  # fmt: skip

    @property
    def connected(self) -> int:
        """Sources linked now."""
        return len(self.sessions)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        origin: str | None = None
        try:
            frames = FrameReader(reader, f"mirror source {peer}")
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                origin = await self._authenticate(frames, writer)
            if origin is None:
                return
            older = self.sessions.get(origin)
            if older is not None:
                older.close()  # the source has one link: the newer one wins
            self.sessions[origin] = writer
            log.info("mirror: source %s linked from %s", origin, peer)
            await self._serve(origin, frames, writer)
        except ReconcileRefused as exc:
            metrics.RECONCILE_REFUSED.inc()
            log.warning("mirror: refusing source %r (%s): %s", origin, peer, exc)
            with contextlib.suppress(OSError, ConnectionError, RuntimeError):
                writer.write(encode(FrameType.REFUSE, Refuse(reason=str(exc), epoch=0)))
                await writer.drain()
        except (OSError, ConnectionError, ProtocolError, TimeoutError, RuntimeError) as exc:
            # RuntimeError: uvloop refuses a write to a transport the source just reset.
            log.info("mirror: link from %s (%s) closed: %s", origin or "?", peer, exc)
        finally:
            if origin is not None and self.sessions.get(origin) is writer:
                del self.sessions[origin]
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def _authenticate(self, frames: FrameReader, writer: asyncio.StreamWriter) -> str | None:
        """The handshake; the authenticated origin, or None (refused)."""
        nonce = new_nonce()
        challenge = Challenge(version=RECONCILE_VERSION, name=self.name, nonce=nonce)
        writer.write(encode(FrameType.CHALLENGE, challenge))
        ftype, payload = await frames.next()
        if ftype is not FrameType.HELLO:
            raise ProtocolError(f"expected HELLO, got {ftype.name}")
        hello = decode_model(Hello, payload)
        names = certificate_names(writer)
        if names is not None and hello.name not in names:
            # The certificate is the source's identity: a certificate of the other site's
            # CA that does not name this origin (a broker's own, the AMQPS one) cannot
            # mirror here, whatever token it holds.
            named = f"its certificate names {sorted(names)}, not the origin {hello.name!r}"
            metrics.REFUSED.labels("identity").inc()
            log.warning("mirror: refusing source %r: %s", hello.name, named)
            writer.write(encode(FrameType.REFUSE, Refuse(reason=named, epoch=0)))
            await writer.drain()
            return None
        transcript = Transcript(self.name, hello.name, nonce, hello.nonce)
        why = transcript.refusal(self.key, hello.proof, "source")
        if why is not None:
            log.warning("mirror: refusing source %r: %s", hello.name, why)
            writer.write(encode(FrameType.REFUSE, Refuse(reason=why, epoch=0)))
            await writer.drain()
            return None
        proof = transcript.proof(self.key, "mirror")
        writer.write(encode(FrameType.WELCOME, Welcome(epoch=0, proof=proof)))
        frames.authenticated()
        epoch = 0
        refused = self.site.link_refusal(hello.name, hello.epoch)
        if refused is not None:
            why, epoch = refused
        others = [o for o in self.applier.origins() if o != hello.name]
        if why is None and others and self.applier.ids is None:
            # Topology events are full state: two origins would delete each other's queues
            # (the bidirectional mode's per-object deltas and id map accept several).
            why = f"{self.name} mirrors origin {others[0]!r}; one origin per mirror"
        if why is not None:
            log.warning("mirror: refusing source %r: %s", hello.name, why)
            writer.write(encode(FrameType.REFUSE, Refuse(reason=why, epoch=epoch)))
            await writer.drain()
            return None
        self.epochs[hello.name] = hello.epoch
        writer.write(encode_u64(FrameType.ACK, self.applier.applied(hello.name)))
        await writer.drain()
        return hello.name

    async def _serve(self, origin: str, frames: FrameReader, writer: asyncio.StreamWriter) -> None:
        acks: asyncio.Queue[tuple[asyncio.Future[bool], int]] = asyncio.Queue()
        acker = asyncio.get_running_loop().create_task(self._acknowledge(acks, writer))
        session = _Session()
        try:
            while not acker.done():
                events = await self._read_events(origin, frames, writer, session)
                session.compared, session.held = True, {}
                if session.claim is not None:
                    # The comparison is complete (a source sends its events after it).
                    claim, session.claim = session.claim, None
                    self.site.settle_loss(origin, claim)
                refused = self.site.link_refusal(origin, self.epochs.get(origin, 0))
                if refused is not None:
                    # Promoted (or passive) since: apply nothing more, say why.
                    why, epoch = refused
                    writer.write(encode(FrameType.REFUSE, Refuse(reason=why, epoch=epoch)))
                    await writer.drain()
                    raise ConnectionError(why)
                await self._while_blocked(origin)
                result = self.applier.apply(origin, events)
                self.site.progressed()
                metrics.HELD_ACKS.set(len(self.applier.holding))
                if result.applied:
                    acks.put_nowait((self.futures.wait(result.batch), result.seq))
                    mark = self.applier.mark(origin)
                    if mark is not None:
                        metrics.LAST_APPLIED_AGE.set(max(0.0, mark.applied_at - mark.created))
                if result.retry is not None:
                    await acks.join()  # acknowledge what was applied, then let it re-send
                    raise ConnectionError(result.retry)
        finally:
            failed = await cancel_and_wait(acker)
            if failed is not None and not isinstance(failed, (OSError, ConnectionError)):
                raise failed

    async def _while_blocked(self, origin: str) -> None:
        """Honour this broker's resource alarms: apply nothing while one is raised (the
        source's window fills and it stops sending; its idle PINGs say why)."""
        alarm = self.site.blocked()
        if alarm is None:
            return
        log.warning("mirror: %s alarm: applying nothing from %s until it clears", alarm, origin)
        # The resource monitor re-checks once a second; no event marks the clearing.
        while self.site.blocked() is not None:  # noqa: ASYNC110
            await asyncio.sleep(BLOCKED_POLL)
        log.info("mirror: alarm cleared: applying %s's events again", origin)

    async def _read_events(
        self, origin: str, frames: FrameReader, writer: asyncio.StreamWriter, session: _Session
    ) -> list[tuple[int, bytes]]:
        """The next events: at least one, and every one already received (up to a bound).
        Heartbeats on the way are echoed."""
        events: list[tuple[int, bytes]] = []
        while len(events) < MAX_APPLY_EVENTS:
            frame = frames.received() if events else await frames.next(SILENCE)
            if frame is None:
                break
            ftype, payload = frame
            if ftype is FrameType.BATCH:
                seq, _flags, body = decode_batch(payload)
                events.append((seq, body))
            elif ftype is FrameType.RECONCILE and not events and self.applier.ids is None:
                await self._reconcile(origin, payload, writer, session)
            elif ftype is FrameType.PING:
                beat = decode_heartbeat(payload)
                if beat is not None:
                    self.site.heard(origin, beat)
                    writer.write(encode(FrameType.PING, payload))
            else:
                raise ProtocolError(f"unexpected {ftype.name} from a mirror source")
        return events

    async def _reconcile(
        self, origin: str, payload: bytes, writer: asyncio.StreamWriter, session: _Session
    ) -> None:
        """Answer a source's comparison of its pending seed with what this mirror holds
        now (every event read before it is applied: the source sends none before), in
        slices of work: the loop serves clients between them whatever the frame asks."""
        if session.compared:
            raise ReconcileRefused("a RECONCILE after the session's first event")
        request, why = refusal(payload)
        if request is None:
            raise ReconcileRefused(why or "a RECONCILE refused")
        if request.marks:
            seen = self.site.marks_seen(origin, request.marks)
            if isinstance(seen, str):
                raise ReconcileRefused(seen)
            session.claim = seen
        answers: list[RangeAnswer] = []
        for said in answering(self.applier.vhost, request, session.held, session.claim):
            if said is None:
                await asyncio.sleep(0)  # a slice of work done: the loop's other tasks
            else:
                answers.append(said)
        writer.write(encode(FrameType.RECONCILE, wire(ReconcileReply(answers=answers))))

    async def _acknowledge(
        self, acks: asyncio.Queue[tuple[asyncio.Future[bool], int]], writer: asyncio.StreamWriter
    ) -> None:
        """ACK each applied seq once its batch is complete, in order; PING when idle."""
        while True:
            try:
                async with asyncio.timeout(1.0):
                    future, seq = await acks.get()
            except TimeoutError:
                writer.write(encode(FrameType.PING, MirrorBeat(blocked=self.site.blocked())))
                await writer.drain()
                continue
            ok = await future
            acks.task_done()
            if not ok:
                raise ConnectionError(f"the batch applying up to event {seq} failed here")
            writer.write(encode_u64(FrameType.ACK, seq))
            await writer.drain()
