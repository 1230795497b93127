"""A full disk on the promoted site while its forced promotion journals the seed (issue
14; docs/mirror.md, "DR failover"). Real brokers, site B's data on a tmpfs of its own
(root only: skipped where mounting is refused), pika publishers with confirms.

The promotion stands (its role record is durable) but B serves no client until a seed
is: what its consumers settled before would be orphans on the old source."""

from __future__ import annotations

import shutil
from pathlib import Path

import pika
import pytest
from disks import small_tmpfs
from mirrorsites import Sites, browse, depth, mirror_status, publish
from test_mirror_attack14 import orphaned, take
from test_mirror_reseed import bodies

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

BODY = 10_000  # bytes per message: 300 of them fill more than the space left
KEEP_FREE = 2 * 1024 * 1024  # bytes left on B's disk when it is promoted


def big(prefix: str, n: int) -> list[bytes]:
    return [body.ljust(BODY, b".") for body in bodies(prefix, n)]


def rig(tmp_path: Path) -> Sites:
    """Reversible sites, B writing until its disk is full (no free-space alarm first)."""
    sites = Sites(tmp_path, reversible=True)
    sites.mirror.extra_args += ["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)]
    return sites


def full_disk_promotion(sites: Sites, disk: Path) -> Path:
    """A holds 300 big messages (mirrored) and 5 more (not): A is lost, B is forced while
    its disk has `KEEP_FREE` left, too little for the seed. The filler file, for the
    caller to remove."""
    publish(sites.source, "orders", big("a", 300))
    sites.caught_up()
    sites.mirror.stop()
    publish(sites.source, "orders", bodies("lost", 5))
    sites.source.kill()
    sites.mirror.start()
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - KEEP_FREE))
    switch = sites.promote_mirror(force=True)
    assert switch.forced
    assert switch.seed_pending is not None
    assert "the journal refused its seed" in switch.seed_pending
    assert "disk full: batch" in sites.mirror.log_path.read_text()
    return filler


def refused(broker: BrokerProcess) -> str:
    """The reason `broker` gives a client at connection.open (it must give one)."""
    with pytest.raises(pika.exceptions.AMQPConnectionError) as caught:
        pika.BlockingConnection(pika.URLParameters(broker.url)).close()
    return str(caught.value)


def seed_durable(sites: Sites) -> None:
    """Wait for B's seed to be queued again and durable (the disk has room)."""
    wait_for("B's seed durable", lambda: mirror_status(sites.mirror)["seed_pending"] is None, 30)


def the_old_source_back_holds_what_the_promoted_site_does(
    sites: Sites, consumed: list[bytes]
) -> None:
    """A returns after B's forced promotion on a full disk (300 messages of A's, 10 of
    them `consumed` on B, 2 published there): its 5 unmirrored messages counted and
    orphaned, nothing else; every other message once on both sites."""
    sites.old_source_back()
    assert mirror_status(sites.source)["unmirrored"]["messages"] == 5
    assert sorted(orphaned(sites.source.url)) == sorted(bodies("lost", 5))
    expected = [*big("a", 300)[10:], *bodies("b", 2)]
    assert consumed == big("a", 10)
    assert browse(sites.source, "orders") == expected
    assert drain(sites.mirror.url, "orders") == expected


@pytest.mark.slow
def test_a_full_disk_during_the_forced_seed_orphans_only_what_was_never_mirrored(
    tmp_path: Path,
) -> None:
    """B is forced while its disk has 2 MiB left: the seed (3 MB) fails its group commit
    and is rolled back; the promotion stands, clients wait. Space comes back, the seed is
    queued again and durable, B's consumers ack 10 messages, A returns: its 5 unmirrored
    messages are counted and orphaned, nothing else; every message once on both sites,
    the 10 acked nowhere."""
    with small_tmpfs(tmp_path / "b", "48m") as disk, rig(tmp_path) as sites:
        filler = full_disk_promotion(sites, disk)
        filler.unlink()
        seed_durable(sites)
        consumed = take(sites.mirror.url, "orders", 10)
        publish(sites.mirror, "orders", bodies("b", 2))
        the_old_source_back_holds_what_the_promoted_site_does(sites, consumed)


@pytest.mark.slow
def test_a_promoted_site_refuses_clients_while_its_seed_is_not_durable_then_takes_them(
    tmp_path: Path,
) -> None:
    """While B's seed is not durable a client can neither publish nor settle there: it is
    refused at connection.open with the reason, which `/status`, `/readyz`, a replayed
    promotion and the log all give. Once the disk has room (its alarm cleared) the seed
    is queued again by itself; then B takes publishes and acks."""
    with small_tmpfs(tmp_path / "b", "48m") as disk, rig(tmp_path) as sites:
        filler = full_disk_promotion(sites, disk)
        why = refused(sites.mirror)
        assert "320" in why
        assert "not serving clients yet: the journal refused its seed" in why
        status = mirror_status(sites.mirror)
        assert status["role"] == "source"
        assert "the journal refused its seed" in status["seed_pending"]
        ready = sites.mirror.admin.readiness(timeout=5)
        assert not ready.ready
        assert "not serving clients yet" in (ready.reason or "")
        assert sites.promote_mirror(force=True).seed_pending == status["seed_pending"]
        assert "clients refused until then" in sites.mirror.log_path.read_text()

        filler.unlink()
        seed_durable(sites)
        assert "seed is durable: clients taken again" in sites.mirror.log_path.read_text()
        assert sites.promote_mirror(force=True).seed_pending is None
        publish(sites.mirror, "orders", bodies("b", 2))
        assert take(sites.mirror.url, "orders", 3) == big("a", 3)
        assert depth(sites.mirror, "orders") == 300 - 3 + 2
