"""A link session that begins while the seed is still in its group commit compares it
before streaming it (docs/mirror.md, "The seed as a delta" and "DR failover").

Found in CI: a site promoted by force queued its seed at its first activation, in the
same turn as its link's session began; the session saw no complete snapshot event to
compare, streamed the seed whole, and the old source, whose loss count rides on the
comparison's marks, never counted what it had lost. Sans-I/O over a real journal
(`sansio.Harness`) and a real socket pair: the link's side of the comparison against
an in-process mirror that answers with `delta.answer`.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from test_mirror_delta import Held
from test_mirror_units import QID, TOPOLOGY, message

from twinmq.broker.mirror import delta
from twinmq.broker.mirror.applier import MirrorApplier
from twinmq.broker.mirror.delta import RECONCILE_VERSION, ReconcileRequest, wire
from twinmq.broker.mirror.events import decode_event, encode_definitions_event, encode_ops_event
from twinmq.broker.mirror.link import MirrorLink
from twinmq.broker.mirror.source import MirrorSource
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import FrameType, decode_model, encode
from twinmq.testing.sansio import Harness


def test_a_session_begun_as_the_seed_is_queued_compares_it_before_streaming(
    tmp_path: Path,
) -> None:
    site = Harness(tmp_path / "source")
    # Ten messages in queue `q` (put there as a mirror would apply them).
    applier = MirrorApplier(site.vhost, site.committer, site.clock.time)
    applier.apply("z", [(1, encode_definitions_event(TOPOLOGY, 0.0))])
    applier.apply("z", [(2, encode_ops_event([message(mid) for mid in range(1, 11)], 0.0))])
    site.commit()
    source = MirrorSource(site.vhost, site.committer, site.clock.time)
    site.committer.tap = source
    site.committer.await_durable(source)
    source.activate()  # the first activation: the seed queued, its batch not yet closed
    assert not source.settled_through(source.head)
    link = MirrorLink(source, "127.0.0.1:1", "key", "site-a")
    link._mirror_version = RECONCILE_VERSION  # as its CHALLENGE would say
    asked: list[ReconcileRequest] = []

    async def session() -> dict[int, bytes]:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        mirror_reader, mirror_writer = await asyncio.open_connection(sock=theirs)

        async def mirror() -> None:
            # A mirror that holds the first five messages already.
            frames = FrameReader(mirror_reader, "source")
            while True:
                ftype, payload = await frames.next()
                assert ftype is FrameType.RECONCILE
                request = decode_model(ReconcileRequest, payload)
                asked.append(request)
                reply = delta.answer(Held({QID: set(range(1, 6))}), request)
                mirror_writer.write(encode(FrameType.RECONCILE, wire(reply)))

        answering = asyncio.get_running_loop().create_task(mirror())
        try:
            return await link._reconcile(FrameReader(reader, "mirror"), writer, 0)
        finally:
            answering.cancel()
            writer.close()
            mirror_writer.close()

    try:
        deltas = site.loop.run_until_complete(session())
    finally:
        site.close()
    assert asked, "the seed was streamed whole, never compared"
    # Every snapshot event compared now goes as its delta: the five the mirror lacks.
    sent = [op.mid for body in deltas.values() for op in decode_event(0, body).ops]
    assert sorted(sent) == [6, 7, 8, 9, 10]
