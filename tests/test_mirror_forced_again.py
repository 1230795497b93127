"""A second forced failover, after a switchover and a failback, is settled like the first
(docs/mirror.md, "DR failover"): the promoted site had been the source before, so its
replication queue already exists and its first activation made no seed; without one the
link never compared, the old source never counted what it lost and kept those messages
among its live ones, diverged from the site it now mirrors."""

from __future__ import annotations

from pathlib import Path

from mirrorsites import Sites, demote, mirror_status, promote, publish, queues
from test_mirror_reseed import ORPHANS, bodies

from twinmq.testing.queues import drain


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
        lost = sites.loss_counted()
        assert lost["messages"] == 5
        assert mirror_status(sites.source)["queue_events"] == 0
        assert drain(sites.source.url, "orders") == [*bodies("a", 10), *bodies("b", 3)]
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))


def test_messages_in_a_queue_the_promoted_site_never_knew_become_orphans_not_deleted(
    tmp_path: Path,
) -> None:
    """A queue declared at the old source during the partition is not in the promoted
    site's seed: its topology deletes the queue there, and the confirmed messages in it
    must go to the orphan queue with it, not be erased."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "new", bodies("lost", 5))  # declared during the partition
        sites.fail_over_by_force()
        sites.old_source_back()
        lost = sites.loss_counted()
        assert lost["messages"] == 5
        assert drain(sites.source.url, "orders") == bodies("a", 10)
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))
        # Emptied, kept until B's next topology (deleted with the seed's own topology, a
        # crash before the orphans' batch would have taken them along).
        assert queues(sites.source)["new"]["messages"] == 0
        publish(sites.mirror, "later", [b"l"])
        sites.caught_up(source=sites.mirror)
        assert "new" not in queues(sites.source) and "later" in queues(sites.source)
