"""A DR mirror site that is an HA pair: what its active applies from the source (the
source's topology and messages) is on its passive too, so a failover of the mirror pair
loses none of it (docs/mirror.md, "Full mesh": the pair's failover).

Found tracing the mesh pair's failover loss: the mirror's applier replaces the topology
on its active whole (`VirtualHost.apply_definitions`), and that path told the pair's
passive nothing; the passive skipped the messages of the queues it did not know (their
batches journaled whole, their queues in memory without them), and, promoted, lacked
them."""

from __future__ import annotations

from pathlib import Path

from mirrorsites import ORIGIN, TOKEN, depth, publish
from test_mirror_reseed import bodies

from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


def test_a_mirror_pairs_passive_holds_the_applied_topology_and_messages_after_a_failover(
    tmp_path: Path,
) -> None:
    ports = {"m1": free_port(), "m2": free_port()}
    pair = Pair(tmp_path / "mirror", replication_timeout=2.0, names=("m1", "m2"), link=False)
    for name, broker in pair.brokers.items():
        broker.env.update({
            "TWINMQ_MIRROR_PORT": str(ports[name]), "TWINMQ_MIRROR_TOKEN": TOKEN,
            "TWINMQ_MIRROR_ROLE": "replica",
        })  # fmt: skip
    source_args = ["--mirror-to", f"127.0.0.1:{ports['m1']}", "--mirror-token", TOKEN,
                   "--mirror-id", ORIGIN]  # fmt: skip
    with pair, BrokerProcess(tmp_path / "a" / "data", name="site-a", extra_args=source_args) as a:
        publish(a, "orders", bodies("a", 50))  # a queue the mirror's applier declares
        wait_for("m1 applied the 50", lambda: depth(pair.active, "orders") == 50, 60)
        assert pair.failover()  # kill -9 of m1: m2 promoted
        assert pair.active.name == "m2"
        assert drain(pair.active.url, "orders") == bodies("a", 50)
