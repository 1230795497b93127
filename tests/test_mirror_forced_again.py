"""A second forced failover, after a switchover and a failback, is settled like the first
(docs/mirror.md, "DR failover"): the promoted site had been the source before, so its
replication queue already exists and its first activation made no seed; without one the
link never compared, the old source never counted what it lost and kept those messages
among its live ones, diverged from the site it now mirrors."""

from __future__ import annotations

from pathlib import Path

from mirrorsites import Sites, demote, mirror_status, promote, publish
from test_mirror_reseed import ORPHANS, bodies

from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


def test_a_second_forced_failover_counts_and_orphans_what_the_old_source_lost(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        # A switchover to B and a failback to A: B has been a source.
        assert sites.promote_mirror(demote(sites.source).token).role == "source"
        publish(sites.mirror, "orders", bodies("b", 3))
        sites.caught_up(source=sites.mirror)
        assert promote(sites.source, demote(sites.mirror).token).role == "source"
        sites.caught_up()
        # A partition, A confirms 5 that B never gets, A is lost: B forced.
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 5))
        sites.fail_over_by_force()
        sites.old_source_back()
        lost = wait_for("the loss counted", lambda: mirror_status(sites.source)["unmirrored"], 30)
        assert lost["messages"] == 5
        assert mirror_status(sites.source)["queue_events"] == 0
        assert drain(sites.source.url, "orders") == [*bodies("a", 10), *bodies("b", 3)]
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))
