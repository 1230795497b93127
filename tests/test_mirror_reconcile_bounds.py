"""A source holding only the mirror token cannot stall the mirror with its comparison, nor
make an old source erase its backlog on its word (docs/mirror.md, "The seed as a delta"
and "DR failover": "The RPO as a count").

The bounds of one RECONCILE frame and the loss claim's verification are checked sans-I/O;
then between real sites: a test speaks the mirror protocol by hand over an authenticated
link (it holds the token) and sends heavy, oversized and malformed RECONCILE frames to a
mirror that keeps serving its AMQP clients meanwhile and refuses the link with the
reason; and, as the promoted site of a forced failover, marks to the old source: one above
anything it made is refused with its backlog kept (the real promoted site then counts and
drops as before), one claiming everything applied without its seed showing it leaves the
backlog in place, counted as unverified.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mirrorsites import ORIGIN, TOKEN, Sites, channel, metric, mirror_status, publish
from test_mirror_delta import Held, snapshot_chunks
from test_mirror_reseed import ORPHANS, bodies

from twinmq.broker.journal import Settle, StoredMessage
from twinmq.broker.mirror import delta
from twinmq.broker.mirror.auth import Transcript, mirror_key
from twinmq.broker.mirror.delta import (
    LEAF,
    MAX_FRAME_IDS,
    MAX_PROBES,
    MAX_RECONCILE_BYTES,
    LossClaim,
    RangeProbe,
    ReconcileReply,
    ReconcileRequest,
    answering,
    digest,
    refusal,
    wire,
)
from twinmq.broker.mirror.events import TOP_MID, encode_ops_event
from twinmq.broker.replication.handshake import new_nonce
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import (
    Challenge,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    decode_model,
    decode_u64,
    encode,
    encode_batch,
)
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.queues import drain

# -- sans-I/O: the bounds, the source's cut, the claim -------------------------------------


def probe(qid: int, mids: list[int], lo: int = 0, hi: int = TOP_MID) -> RangeProbe:
    listed = mids if len(mids) <= LEAF else None
    return RangeProbe(qid=qid, lo=lo, hi=hi, count=len(mids), digest=digest(mids), mids=listed)


def test_a_reconcile_beyond_one_frames_bounds_is_refused_with_the_reason() -> None:
    many = ReconcileRequest(probes=[probe(1, [])] * (MAX_PROBES + 1))
    assert "probes" in (refusal(wire(many))[1] or "")
    assert "bytes" in (refusal(b" " * (MAX_RECONCILE_BYTES + 1))[1] or "")
    assert "malformed" in (refusal(b'{"probes": 7}')[1] or "")
    fat = probe(1, list(range(4096)))
    heavy = ReconcileRequest(probes=[fat] * (MAX_FRAME_IDS // 4096 + 1))
    assert "ids" in (refusal(wire(heavy))[1] or "")
    upside_down = RangeProbe(qid=1, lo=9, hi=3, count=0, digest="")
    too_many = RangeProbe(qid=1, lo=0, hi=3, count=5, digest="")
    unsorted = RangeProbe(qid=1, lo=0, hi=9, count=2, digest="", mids=[5, 2])
    outside = RangeProbe(qid=1, lo=0, hi=9, count=1, digest="", mids=[12])
    miscounted = RangeProbe(qid=1, lo=0, hi=9, count=3, digest="", mids=[2])
    for bad in (upside_down, too_many, unsorted, outside, miscounted):
        request, why = refusal(wire(ReconcileRequest(probes=[bad])))
        assert request is None and why is not None and why.startswith("RECONCILE probe 0")
    marks = ReconcileRequest(probes=[], marks={f"o{i}": 1 for i in range(100)})
    assert "marks" in (refusal(wire(marks))[1] or "")
    request, why = refusal(wire(ReconcileRequest(probes=[fat, probe(1, [3, 4])])))
    assert why is None and request is not None and len(request.probes) == 2


class Kept:
    """A mirror's queues (the answer reads them), built once."""

    def __init__(self, held: dict[int, set[int]]) -> None:
        self.queues = {qid: Held({qid: mids}).queue_by_qid(qid) for qid, mids in held.items()}

    def queue_by_qid(self, qid: int) -> Any:
        return self.queues.get(qid)


def test_a_source_cuts_its_comparison_into_frames_the_mirror_accepts() -> None:
    # 1,200 snapshot events (more probes than one frame takes) of which the mirror holds
    # every other id: each range differs and is split down to listed ranges.
    source = list(range(1, 1200 * 64 + 1))
    chunks = snapshot_chunks(4, source, 64)
    mirror = Kept({4: set(source[::2])})
    requests: list[ReconcileRequest] = []
    reconciler = delta.Reconciler(chunks)
    while (request := reconciler.request()) is not None:
        assert refusal(wire(request))[1] is None  # every frame within the bounds
        requests.append(request)
        reconciler.answered(delta.answer(mirror, request))  # type: ignore[arg-type]
    assert len(requests) > 2 and max(len(r.probes) for r in requests) == MAX_PROBES
    assert reconciler.rounds == len(requests)
    assert {m for c in chunks for m in c.send} == set(source[1::2])


def test_the_answer_gives_its_loop_turns_between_slices_of_work() -> None:
    mids = list(range(1, 300_001))
    starts = range(0, 200_000, 4096)
    request = ReconcileRequest(
        probes=[probe(9, mids[i : i + 4096], i + 1, i + 4096) for i in starts]
    )
    items = list(answering(Held({9: set(mids)}), request))  # type: ignore[arg-type]
    turns = sum(1 for item in items if item is None)
    answers = [item for item in items if item is not None]
    assert len(answers) == len(request.probes) and all(a.same for a in answers)
    assert turns >= 300_000 // delta.SLICE  # reading the queue, then comparing: in slices


def test_a_claim_is_verified_only_by_what_the_probes_show() -> None:
    def stored(mid: int) -> StoredMessage:
        return StoredMessage(mid, 5, "", "q", b"h", b"b", None)

    claimed = [
        (101, [stored(1), stored(2)]),  # both held alike there: verified
        (102, [stored(40)]),  # listed there: verified
        (103, [stored(70)]),  # not shown there: unverified
        (104, [stored(80), Settle(5, 80)]),  # settled in the claim itself: nothing to show
        (105, []),  # no message: nothing to show
    ]
    claim = LossClaim(105, claimed)
    mirror = Held({5: {1, 2, 70}})  # the old source still holds 1, 2 and 70
    request = ReconcileRequest(
        probes=[probe(5, [1, 2], 0, 30), probe(5, [40], 31, 60), probe(5, [], 61, TOP_MID)]
    )
    answers = [a for a in answering(mirror, request, claim=claim) if a is not None]  # type: ignore[arg-type]
    assert [a.same for a in answers] == [True, False, False]
    assert claim.unverified() == ({103}, 1)


# -- real sites: the protocol spoken by hand --------------------------------------------------


class Raw:
    """A mirror link opened by hand (the test holds the token): handshake, then frames."""

    def __init__(self, address: str, origin: str, epoch: int = 0) -> None:
        self.address, self.origin, self.epoch = address, origin, epoch
        self.mark = 0

    async def __aenter__(self) -> Raw:
        host, _, port = self.address.rpartition(":")
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        self.frames = FrameReader(self.reader, "mirror")
        ftype, payload = await self.frames.next(10)
        assert ftype is FrameType.CHALLENGE
        challenge = decode_model(Challenge, payload)
        nonce, key = new_nonce(), mirror_key(TOKEN)
        transcript = Transcript(challenge.name, self.origin, challenge.nonce, nonce)
        proof = transcript.proof(key, "source")
        hello = Hello(name=self.origin, epoch=self.epoch, nonce=nonce, proof=proof)
        self.writer.write(encode(FrameType.HELLO, hello))
        ftype, payload = await self.frames.next(10)
        assert ftype is FrameType.WELCOME, f"{ftype.name}: {payload!r}"
        self.frames.authenticated()
        ftype, payload = await self.next()
        assert ftype is FrameType.ACK, f"{ftype.name}: {payload!r}"
        self.mark = decode_u64(payload)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def next(self) -> tuple[FrameType, bytes]:
        """The next frame that is not an idle PING."""
        while True:
            ftype, payload = await self.frames.next(30)
            if ftype is not FrameType.PING:
                return ftype, payload

    async def refused(self) -> str:
        """The REFUSE's reason; the link is then closed."""
        ftype, payload = await self.next()
        assert ftype is FrameType.REFUSE, f"{ftype.name}: {payload!r}"
        with pytest.raises((ProtocolError, ConnectionError, EOFError)):
            await self.frames.next(30)
        return decode_model(Refuse, payload).reason


def held_mids(n: int, first: int) -> list[int]:
    return list(range(first, first + n))


def test_a_hostile_reconcile_is_answered_in_slices_or_refused_while_clients_are_served(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path) as sites:
        publish(sites.source, "big", [b"x"] * 3000)
        sites.caught_up()
        sites.source.stop()  # the test speaks for the source's origin from now on
        frames = 40
        # Within the bounds and as heavy as allowed: ranges over everything, each one
        # counted as the 4,096 ids it cannot hold (compared) and listed small ones.
        heavy = ReconcileRequest(
            probes=[probe(q, held_mids(4096, 1), 1, 4096) for q in range(MAX_FRAME_IDS // 4096)]
        )
        done, connected, sent = threading.Event(), threading.Event(), threading.Event()
        answered: list[int] = []
        served_while_answering: list[int] = []

        async def hostile() -> None:
            async with Raw(sites.mirror_address, ORIGIN) as link:
                payload = wire(heavy)
                for _ in range(frames):
                    link.writer.write(encode(FrameType.RECONCILE, payload))
                await link.writer.drain()
                sent.set()
                for _ in range(frames):
                    ftype, reply = await link.next()
                    assert ftype is FrameType.RECONCILE
                    answered.append(len(ReconcileReply.model_validate_json(reply).answers))
            done.set()

        def client() -> None:
            connection, ch = channel(sites.mirror)
            try:
                while not done.is_set():
                    ch.queue_declare("big", passive=True)  # an AMQP round trip
                    connected.set()
                    if sent.is_set() and len(answered) < frames:
                        served_while_answering.append(len(answered))
            finally:
                connection.close()

        reader = threading.Thread(target=client)
        reader.start()
        try:
            # Connected first: a slow connection set-up is not what the race is about.
            assert connected.wait(60), "the AMQP client never got a round trip"
            asyncio.run(hostile())
        finally:
            done.set()
            reader.join()
        assert answered == [len(heavy.probes)] * frames
        assert served_while_answering, "no AMQP round trip while the RECONCILEs were answered"

        async def refused(payload: bytes) -> str:
            async with Raw(sites.mirror_address, ORIGIN) as link:
                link.writer.write(encode(FrameType.RECONCILE, payload))
                return await link.refused()

        oversized = b'{"probes":[' + b" " * MAX_RECONCILE_BYTES + b"]}"
        assert "bytes" in asyncio.run(refused(oversized))
        crowded = wire(ReconcileRequest(probes=[probe(1, [])] * (MAX_PROBES + 1)))
        assert "probes" in asyncio.run(refused(crowded))
        assert metric(sites.mirror, "twinmq_mirror_reconcile_refused_total") == 2
        assert "refusing source 'site-a'" in sites.mirror.log_path.read_text()
        assert len(drain(sites.mirror.url, "big")) == 3000  # the mirror serves on


@pytest.fixture
def fenced(tmp_path: Path) -> Iterator[tuple[Sites, FaultProxy, int]]:
    """A forced failover to B during a partition (A has 5 confirmed messages B never
    got); A, back, is fenced by B, whose link to A is cut (a proxy to nowhere) so the test
    speaks as B first. Yields (sites, proxy, B's epoch)."""
    with FaultProxy("127.0.0.1:1") as proxy:
        sites = Sites(tmp_path, reversible=True, mirror_to=proxy.address)
        with sites:
            publish(sites.source, "orders", bodies("a", 10))
            sites.caught_up()
            sites.mirror.stop()  # a partition: B will never see what follows
            publish(sites.source, "orders", bodies("lost", 5))
            sites.fail_over_by_force()
            sites.old_source_back(caught_up=False)
            epoch = mirror_status(sites.mirror)["epoch"]
            yield sites, proxy, epoch


def reconcile_as(address: str, origin: str, epoch: int, marks: dict[str, int]) -> str | None:
    """One RECONCILE carrying `marks` (no probe), then an empty event: the REFUSE's
    reason, or None once the event was acknowledged (the comparison settled)."""

    async def run() -> str | None:
        async with Raw(address, origin, epoch) as link:
            request = ReconcileRequest(probes=[], marks=marks)
            link.writer.write(encode(FrameType.RECONCILE, wire(request)))
            ftype, payload = await link.next()
            if ftype is FrameType.REFUSE:
                return decode_model(Refuse, payload).reason
            assert ftype is FrameType.RECONCILE
            seq = link.mark + 1
            link.writer.write(encode_batch(seq, 0, encode_ops_event([], 0.0)))
            while True:
                ftype, payload = await link.next()
                assert ftype is FrameType.ACK, f"{ftype.name}: {payload!r}"
                if decode_u64(payload) >= seq:
                    return None

    return asyncio.run(run())


def test_a_forged_mark_above_anything_the_old_source_made_is_refused_and_nothing_dropped(
    fenced: tuple[Sites, FaultProxy, int],
) -> None:
    sites, proxy, epoch = fenced
    backlog = mirror_status(sites.source)["queue_events"]
    assert backlog >= 1
    address = f"127.0.0.1:{sites.source_port}"
    why = reconcile_as(address, "site-b", epoch, {ORIGIN: 1 << 62})
    assert why is not None and "made none after" in why
    assert metric(sites.source, "twinmq_mirror_reconcile_refused_total") == 1
    status = mirror_status(sites.source)
    assert status["unmirrored"] is None and status["queue_events"] == backlog  # kept
    # The real promoted site, linked at last, counts and drops exactly as before.
    proxy.retarget(address)
    sites.caught_up(source=sites.mirror)
    # Counted when the comparison ends (the session's first event), which the promoted
    # site's "caught up" can be seen a moment before.
    lost = sites.loss_counted()
    assert (lost["messages"], lost["settles"]) == (5, 0)
    assert (lost["unverified_events"], lost["unverified_messages"]) == (0, 0)
    assert mirror_status(sites.source)["queue_events"] == 0  # dropped: B's seed orphans them
    assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))


def test_a_mark_claiming_everything_without_the_seed_showing_it_keeps_the_backlog(
    fenced: tuple[Sites, FaultProxy, int],
) -> None:
    sites, _, epoch = fenced
    backlog = mirror_status(sites.source)["queue_events"]
    address = f"127.0.0.1:{sites.source_port}"
    # A's newest event, as a refusal says it; then "applied everything": that mark, with
    # no probe to show it.
    why = reconcile_as(address, "site-b", epoch, {ORIGIN: 1 << 62})
    assert why is not None
    mark = int(re.search(r"made none after (\d+)", why).group(1))  # type: ignore[union-attr]
    assert reconcile_as(address, "site-b", epoch, {ORIGIN: mark}) is None
    lost = sites.loss_counted()
    assert lost["applied_seq"] == mark
    assert (lost["events"], lost["messages"]) == (0, 0)  # what the claim says...
    assert lost["unverified_messages"] == 5  # ...and what nothing showed: the 5 lost
    assert 1 <= lost["unverified_events"] <= backlog
    assert mirror_status(sites.source)["queue_events"] == lost["unverified_events"]  # kept
    assert "not dropped" in sites.source.log_path.read_text()
