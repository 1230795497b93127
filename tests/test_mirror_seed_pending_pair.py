"""A forced promotion's pending seed survives a failover of the promoted site's HA pair
(issue 14; docs/mirror.md, "DR failover"). Site B is a pair (m1 active, m2 passive), each
on a tmpfs of its own (root only), site A a single broker; pika publishers with confirms.

m1 is forced on a full disk: its seed is refused, "seed pending" is in its role record,
which m2 holds too. m1 is killed and m2 promoted: m2 seeds before it serves anyone, so
what its consumers ack is not an orphan on the old source.

m2 does not hold the seed m1's journal refused: the batch reached it, and m1 withdrew
it there before anyone heard of the failure (docs/replication.md, "A failed batch on the
passive"); only the record's "seed pending" makes m2 seed (its log says it seeded
again)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mirrorsites import ORIGIN, TOKEN, browse, demote, mirror_status, promote, publish
from test_mirror_attack14 import orphaned, take
from test_mirror_attack14_disk import KEEP_FREE, big
from test_mirror_reseed import bodies

from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import NoSmallDisk, Pair
from twinmq.testing.waiting import wait_for


def drained(broker: BrokerProcess) -> bool:
    section = mirror_status(broker)
    return section is not None and section["connected"] and section["queue_events"] == 0


@pytest.mark.slow
def test_the_passive_of_a_promoted_pair_seeds_before_serving_when_the_seed_was_pending(
    tmp_path: Path,
) -> None:
    """A mirrors 300 messages to B (after a switchover and a failback), then 5 more while
    B is away, and is lost. m1 is
    forced with 2 MiB of disk left (its seed refused), then killed; m2, promoted, seeds
    and serves; its consumers ack 10. A returns: it orphans its 5 unmirrored messages and
    nothing else (before, m2 served at once and A was seeded from m2's state when it
    linked: the 10 acked came back as orphans)."""
    mirror_ports = {"m1": free_port(), "m2": free_port()}
    a_port = free_port()
    pair = Pair(
        tmp_path / "b", replication_timeout=2.0, names=("m1", "m2"), link=False,
        disk_bytes=48 * 1024 * 1024,
        broker_args=["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)],
    )  # fmt: skip
    for name, broker in pair.brokers.items():
        broker.env.update({
            "TWINMQ_MIRROR_PORT": str(mirror_ports[name]), "TWINMQ_MIRROR_TOKEN": TOKEN,
            "TWINMQ_MIRROR_ROLE": "replica", "TWINMQ_MIRROR_ID": "site-b",
            "TWINMQ_MIRROR_TO": f"127.0.0.1:{a_port}",
        })  # fmt: skip
    a = BrokerProcess(tmp_path / "a" / "data", name="site-a", extra_args=[
        "--mirror-to", f"127.0.0.1:{mirror_ports['m1']}", "--mirror-token", TOKEN,
        "--mirror-id", ORIGIN, "--mirror-port", str(a_port), "--mirror-role", "source",
    ])  # fmt: skip
    try:
        pair.start()
    except NoSmallDisk as exc:
        pytest.skip(str(exc))
    try:
        with a:
            m1, m2 = pair.active, pair.passive
            publish(a, "orders", big("a", 300))
            # A switchover and a failback first: B's replication queue exists on both of
            # its brokers, so m2's activation would seed nothing by itself.
            token = demote(a).token
            assert token is not None and promote(m1, token).role == "source"
            wait_for("A mirrors B", lambda: drained(m1), 60)
            token = demote(m1).token
            assert token is not None and promote(a, token).role == "source"
            wait_for("B caught up", lambda: drained(a), 60)
            m2.stop()
            m1.stop()  # site B away: what follows never reaches it
            publish(a, "orders", bodies("lost", 5))
            a.kill()
            m1.start()
            m2.start()
            pair.wait_healthy()
            filler = m1.data_dir / "filler"
            filler.write_bytes(b"\0" * (shutil.disk_usage(m1.data_dir).free - KEEP_FREE))
            switch = promote(m1, force=True)
            assert switch.seed_pending is not None
            assert "the journal refused its seed" in switch.seed_pending

            assert pair.failover(on_promoted=filler.unlink)
            assert pair.active is m2
            wait_for("m2's seed durable", lambda: mirror_status(m2)["seed_pending"] is None, 30)
            assert "was not durable when this broker took over" in m2.log_path.read_text()
            consumed = take(m2.url, "orders", 10)

            a.start()
            wait_for("A fenced", lambda: mirror_status(a)["role"] == "replica", 30)
            wait_for("A rebuilt by B", lambda: drained(m2), 60)
            lost = wait_for("A's count", lambda: mirror_status(a)["unmirrored"], 30)
            assert lost["messages"] == 5
            assert sorted(orphaned(a.url)) == sorted(bodies("lost", 5))
            assert consumed == big("a", 10)
            assert browse(a, "orders") == big("a", 300)[10:]
    finally:
        pair.stop()
