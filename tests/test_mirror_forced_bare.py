"""A forced failover to a site that holds no message of the old source's (issue 14;
docs/mirror.md, "DR failover"): no durable queue at all, or only empty ones. Its seed
then has nothing to compare, yet the old source must count what it lost (the marks the
comparison carries) and keep those messages as orphans. Real brokers, pika publishers
with confirms."""

from __future__ import annotations

from pathlib import Path

import pytest
from mirrorsites import Sites, mirror_status, publish, queues
from test_mirror_attack14 import orphaned
from test_mirror_reseed import bodies

from twinmq.testing.queues import drain


@pytest.mark.slow
@pytest.mark.parametrize("declared", [False, True], ids=["no-durable-queue", "queues-empty"])
def test_an_old_source_counts_its_loss_to_a_promoted_site_holding_none_of_its_messages(
    tmp_path: Path, declared: bool
) -> None:
    """B mirrored A while A had no queue (or `orders` empty: `declared`); A confirms 5
    messages in `orders` while B is away, then is lost; B is forced, holding no durable
    queue (its seed is topology only) or only empty ones. A, back, counts the 5 as lost
    and keeps them as orphans; its `orders` emptied (without B's queue: kept until B's
    next topology, `applier.py`)."""
    with Sites(tmp_path, reversible=True) as sites:
        if declared:
            publish(sites.source, "orders", [])
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 5))
        sites.fail_over_by_force()
        sites.old_source_back()
        lost = sites.loss_counted()
        assert (lost["messages"], lost["unverified_messages"]) == (5, 0)
        assert sorted(orphaned(sites.source.url)) == sorted(bodies("lost", 5))
        assert drain(sites.source.url, "orders") == []
        if declared:
            assert drain(sites.mirror.url, "orders") == []
        else:
            assert "orders" not in queues(sites.mirror)
        assert mirror_status(sites.source)["queue_events"] == 0  # its backlog dropped
