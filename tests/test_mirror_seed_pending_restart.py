"""A forced promotion's pending seed survives a restart of the promoted site (issue 14;
docs/mirror.md, "DR failover"). Real brokers, site B's data on a tmpfs of its own (root
only: skipped where mounting is refused), pika publishers with confirms.

"Seed pending" is kept in B's role record: B killed while its seed is not durable
comes back still refusing clients, queues the seed again itself once the disk has room,
then serves; the old source orphans only what it never mirrored."""

from __future__ import annotations

from pathlib import Path

import pytest
from disks import small_tmpfs
from mirrorsites import mirror_status, publish
from test_mirror_attack14 import take
from test_mirror_attack14_disk import (
    full_disk_promotion,
    refused,
    rig,
    seed_durable,
    the_old_source_back_holds_what_the_promoted_site_does,
)
from test_mirror_reseed import bodies

from twinmq.testing.waiting import wait_for


@pytest.mark.slow
def test_a_promoted_site_restarted_before_its_seed_is_durable_keeps_refusing_clients(
    tmp_path: Path,
) -> None:
    """B is forced on a full disk (its seed refused), then killed and started again, the
    disk still full: it refuses clients with the reason (before, the pending state was in
    memory only and B served them, so what they acked came back on the old source as
    orphans). The disk gets room: B seeds by itself, serves; its consumers ack 10, A
    returns and orphans its 5 unmirrored messages, nothing else."""
    with small_tmpfs(tmp_path / "b", "48m") as disk, rig(tmp_path) as sites:
        filler = full_disk_promotion(sites, disk)
        sites.mirror.kill()
        sites.mirror.start()
        # Every client is refused. One that connects while B's own retry of the seed
        # fails is closed by that failure (CONNECTION_FORCED, the journal's refusal);
        # once it has failed, connection.open says why.
        reasons: list[str] = []

        def refused_at_open() -> bool:
            reasons.append(refused(sites.mirror))
            return "not serving clients yet" in reasons[-1]

        wait_for("B refusing clients at connection.open", refused_at_open, 30)
        assert all("320" in why for why in reasons), reasons
        status = mirror_status(sites.mirror)
        assert status["role"] == "source"
        assert status["seed_pending"] is not None
        assert not sites.mirror.admin.readiness(timeout=5).ready

        filler.unlink()
        seed_durable(sites)
        assert "was not durable when this broker took over" in sites.mirror.log_path.read_text()
        consumed = take(sites.mirror.url, "orders", 10)
        publish(sites.mirror, "orders", bodies("b", 2))
        sites.mirror.stop()
        sites.mirror.start()  # the cleared state is durable too: served at once
        assert mirror_status(sites.mirror)["seed_pending"] is None
        the_old_source_back_holds_what_the_promoted_site_does(sites, consumed)
