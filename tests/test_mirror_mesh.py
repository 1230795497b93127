"""The full mesh of DR sites (`--mirror-role bidirectional` with several `--mirror-to`):
three and four real sites, each writable, each mirroring its own events to every other,
driven through pika. Every confirmed message ends up exactly once on every site, nothing
is forwarded or loops, each target has its own (durable) cursor on the one replication
queue, a site away keeps only its own backlog growing, and a killed site catches up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pika
import pytest
from mirrorsites import Mesh, browse, channel, depth, metric, mirror_status, publish

from twinmq.broker.admin_client import metric_samples, mirror_reseed_call
from twinmq.broker.journal import StoredMessage
from twinmq.broker.mirror.bidi import BidiMeta, IdMap
from twinmq.broker.mirror.events import record_header
from twinmq.broker.mirror.source import MirrorSource
from twinmq.broker.settings import BrokerSettings, parse_args
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.sansio import Harness
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def message(mid: int) -> StoredMessage:
    body = f"m{mid}".encode()
    return StoredMessage(mid, 3, "", "q", record_header(len(body)), body, None)


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def at(sites: list[BrokerProcess], queue: str, expected: int) -> None:
    """Wait until each of `sites` holds `expected` messages in `queue`."""
    seen: dict[str, int | None] = {}

    def done() -> bool:
        seen.update({site.name: depth(site, queue) for site in sites})
        return all(n == expected for n in seen.values())

    try:
        wait_for(f"{queue} at {expected} on {[s.name for s in sites]}", done, timeout=120)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; depths seen last: {seen}") from None


def converged(mesh: Mesh, queue: str, expected: int) -> None:
    """Every site holds `expected` messages in `queue` and nothing is in flight."""
    at(mesh.sites, queue, expected)
    mesh.caught_up()


def targets(site: BrokerProcess) -> dict[str, dict[str, Any]]:
    """The site's mesh targets by mirror id (its peer's name), as `/status` shows them."""
    section = mirror_status(site)
    assert section is not None, f"{site.name} does not answer"
    return {t["peer"] or t["target"]: t for t in section["targets"]}


def loops(mesh: Mesh) -> dict[str, tuple[float, float]]:
    """Per site: events it passed on, and events that came back to it (or came twice)."""
    return {
        site.name: (
            metric(site, "twinmq_mirror_forwarded_events_total") or 0.0,
            metric(site, "twinmq_mirror_looped_events_total") or 0.0,
        )
        for site in mesh.sites
    }


def test_three_mesh_sites_each_publishing_hold_every_message_once_with_nothing_forwarded(
    tmp_path: Path,
) -> None:
    with Mesh(tmp_path, 3) as mesh:
        a, b, c = mesh.sites
        for site in mesh.sites:
            publish(site, "mesh", bodies(site.name, 100))
        converged(mesh, "mesh", 300)
        expected = sorted(bodies("site-a", 100) + bodies("site-b", 100) + bodies("site-c", 100))
        for site in mesh.sites:
            assert sorted(browse(site, "mesh")) == expected
        # Each origin's events reach every site directly, once: nothing passed on, nothing
        # came back or twice.
        assert all(counts == (0.0, 0.0) for counts in loops(mesh).values())
        # Each target has its own cursor, up to date, and the per-target gauges say so.
        section = mirror_status(a)
        assert section is not None and section["mesh"] and section["state"] == "connected"
        seen = targets(a)
        assert set(seen) == {"site-b", "site-c"}
        for target in seen.values():
            assert target["connected"] and target["queue_events"] == 0
            assert target["acked_seq"] > 0 and target["needs_resync"] is None
        samples = metric_samples(a.admin.metrics(timeout=5))
        for target in seen.values():
            label = f'{{target="{target["target"]}"}}'
            assert samples[f"twinmq_mirror_target_connected{label}"] == 1.0
            assert samples[f"twinmq_mirror_target_queue_events{label}"] == 0.0
        # Acks on C settle the messages of all three origins everywhere.
        assert sorted(drain(c.url, "mesh")) == expected
        converged(mesh, "mesh", 0)
        publish(b, "mesh", bodies("late", 5))
        converged(mesh, "mesh", 5)
        assert sorted(browse(a, "mesh")) == sorted(bodies("late", 5))


def test_a_mesh_site_away_keeps_only_its_backlog_and_catches_up_without_duplicates(
    tmp_path: Path,
) -> None:
    with Mesh(tmp_path, 3) as mesh:
        a, b, c = mesh.sites
        publish(a, "away", bodies("before", 20))
        converged(mesh, "away", 20)
        c.stop()
        # The other two go on between themselves while C is away.
        publish(a, "away", bodies("a", 200))
        publish(b, "away", bodies("b", 200))
        at([a, b], "away", 420)
        wait_for("B's events acknowledged by A", lambda: targets(b)["site-a"]["queue_events"] == 0)
        for site, other in ((a, "site-b"), (b, "site-a")):
            seen = targets(site)
            assert seen[other]["connected"] and seen[other]["queue_events"] == 0
            away = seen["site-c"]
            assert not away["connected"] and away["state"] == "connecting"
            # The backlog is kept for C alone: its own events since C left.
            assert away["queue_events"] > 0 and away["oldest_event_age_seconds"] > 0
            section = mirror_status(site)
            assert section is not None and section["queue_events"] == away["queue_events"]
        c.start()
        converged(mesh, "away", 420)
        expected = sorted(bodies("before", 20) + bodies("a", 200) + bodies("b", 200))
        for site in mesh.sites:
            assert sorted(browse(site, "away")) == expected
        assert all(counts == (0.0, 0.0) for counts in loops(mesh).values())


def test_kill_9_of_mesh_sites_mid_stream_loses_and_repeats_nothing_and_keeps_the_cursors(
    tmp_path: Path,
) -> None:
    with Mesh(tmp_path, 3) as mesh:
        a, b, c = mesh.sites
        connection, ch = channel(a)
        ch.queue_declare("killed", durable=True)
        ch.confirm_delivery()
        for i, body in enumerate(bodies("a", 400)):
            if i == 200:
                b.kill()  # a receiver mid-stream: its marks and applied messages on disk
            ch.basic_publish("", "killed", body, PERSISTENT)
        connection.close()
        a.kill()  # the source mid-stream: its backlog for B (and maybe C) on its disk
        publish(c, "killed", bodies("c", 50))
        a.start()
        b.start()
        converged(mesh, "killed", 450)
        expected = sorted(bodies("a", 400) + bodies("c", 50))
        for site in mesh.sites:
            assert sorted(browse(site, "killed")) == expected
        # The cursors are journaled: with C away (no handshake to tell A its mark), a
        # kill -9 and a restart of A keep C's cursor where it was; A's new events wait
        # for C alone.
        c.stop()
        before = targets(a)["site-c"]["acked_seq"]
        assert before > 0
        a.kill()
        a.start()
        publish(a, "killed", bodies("again", 10))
        at([a, b], "killed", 460)
        away = targets(a)["site-c"]
        assert away["acked_seq"] == before and not away["connected"]
        assert away["queue_events"] > 0
        c.start()
        converged(mesh, "killed", 460)
        assert all(counts == (0.0, 0.0) for counts in loops(mesh).values())


def test_a_mesh_target_past_the_retention_bound_needs_a_resync_alone_and_is_reseeded(
    tmp_path: Path,
) -> None:
    with Mesh(tmp_path, 3, extra_args=["--mirror-retention-events", "50"]) as mesh:
        a, b, c = mesh.sites
        c.stop()
        publish(a, "bounded", bodies("a", 200))
        at([a, b], "bounded", 200)
        seen = targets(a)
        assert seen["site-c"]["needs_resync"] is not None
        assert seen["site-c"]["state"] == "needs-resync"
        # B is in good standing and goes on; the backlog is no longer kept for C.
        wait_for("A's queue trimmed", lambda: (mirror_status(a) or {})["queue_events"] == 0)
        assert targets(a)["site-b"]["connected"]
        samples = metric_samples(a.admin.metrics(timeout=5))
        label = f'{{target="{seen["site-c"]["target"]}"}}'
        assert samples[f"twinmq_mirror_target_needs_resync{label}"] == 1.0
        publish(b, "bounded", bodies("b", 10))
        at([a, b], "bounded", 210)
        c.start()
        # The re-seed (the admin call) rebuilds C; B gets the announcement too and keeps
        # what it holds once.
        reseed = a.admin.send(mirror_reseed_call(), 30)
        assert reseed.messages == 210
        converged(mesh, "bounded", 210)
        expected = sorted(bodies("a", 200) + bodies("b", 10))
        for site in mesh.sites:
            assert sorted(browse(site, "bounded")) == expected
        assert targets(a)["site-c"]["needs_resync"] is None


@pytest.mark.slow
def test_four_mesh_sites_each_publishing_hold_every_message_once(tmp_path: Path) -> None:
    with Mesh(tmp_path, 4) as mesh:
        for site in mesh.sites:
            publish(site, "four", bodies(site.name, 50))
        converged(mesh, "four", 200)
        expected = sorted(b for site in mesh.sites for b in bodies(site.name, 50))
        for site in mesh.sites:
            assert sorted(browse(site, "four")) == expected
            assert len(targets(site)) == 3
        assert all(counts == (0.0, 0.0) for counts in loops(mesh).values())
        assert sorted(drain(mesh.sites[3].url, "four")) == expected
        converged(mesh, "four", 0)


def test_several_targets_from_a_repeated_flag_a_list_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ["--mirror-port", "1", "--mirror-token", "t", "--mirror-role", "bidirectional"]
    flags = parse_args([*common, "--mirror-to", "h1:1", "--mirror-to", "h2:2"])
    assert flags.mirror_targets == ["h1:1", "h2:2"] and flags.mirror_mesh
    one = parse_args([*common, "--mirror-to", "h1:1"])
    assert one.mirror_to == "h1:1" and one.mirror_targets == ["h1:1"] and not one.mirror_mesh
    config = tmp_path / "settings.json"
    config.write_text(json.dumps({"mirror_to": ["h1:1", "h2:2", "h3:3"]}))
    listed = parse_args([*common, "--config", str(config)])
    assert listed.mirror_targets == ["h1:1", "h2:2", "h3:3"] and listed.mirror_mesh
    for name, value in (("TO", "h1:1, h2:2"), ("PORT", "1"), ("TOKEN", "t"),
                        ("ROLE", "bidirectional")):  # fmt: skip
        monkeypatch.setenv(f"TWINMQ_MIRROR_{name}", value)
    from_env = parse_args([])
    assert from_env.mirror_targets == ["h1:1", "h2:2"] and from_env.mirror_mesh


def test_several_targets_need_the_bidirectional_role() -> None:
    with pytest.raises(ValueError, match="several --mirror-to targets need"):
        BrokerSettings(mirror_to="h1:1,h2:2", mirror_token="t")
    with pytest.raises(ValueError, match="several --mirror-to targets need"):
        BrokerSettings(mirror_to="h1:1,h2:2", mirror_port=3, mirror_token="t",
                       mirror_role="source")  # fmt: skip


def test_a_mesh_source_trims_once_every_target_acknowledged_and_journals_each_cursor(
    tmp_path: Path,
) -> None:
    """Sans-I/O over a real journal: one queue, a cursor per target; an event leaves the
    queue only once both targets have it; the cursors come back from the journal; one
    target past the retention bound goes to NeedsResync alone and stops holding the queue."""

    def mesh_source(h: Harness) -> MirrorSource:
        source = MirrorSource(h.vhost, h.committer, h.clock.time)
        source.ids = IdMap(h.vhost, "site-a")
        source.name = "site-a"
        source.targets = ["b:1", "c:1"]
        h.committer.tap = source
        h.committer.await_durable(source)
        source.activate()
        return source

    first = Harness(tmp_path / "a")
    source = mesh_source(first)
    for mid in (1, 2, 3):
        first.committer.add([message(mid)])
        first.commit()
    depth = source.depth
    assert depth >= 4  # the first activation's announcement and three batches
    source.acked(source.head, "b:1")
    assert source.depth == depth and source.backlog("b:1") == 0 and source.backlog("c:1") == depth
    source.acked(source.head, "c:1")
    assert source.depth == 0
    first.committer.add([message(4)])
    first.commit()
    source.acked(source.head, "b:1")
    first.commit()
    cursors = dict(source.cursors)
    first.close()

    reopened = Harness(tmp_path / "a")  # the cursors as journaled
    source = mesh_source(reopened)
    # Message 4's event (b:1 had it, c:1 not) and this activation's re-announcement.
    assert source.cursors == cursors and source.depth == 2
    assert source.backlog("b:1") == 1 and source.backlog("c:1") == 2
    assert source.forward(b"", BidiMeta(origin="site-c", oseq=1, hops=["site-c"])) is None
    source.retention = 2
    for mid in (5, 6, 7):
        reopened.committer.add([message(mid)])
        reopened.commit()
        source.acked(source.head, "b:1")
    assert source.target_resync.keys() == {"c:1"}  # alone: b:1 keeps up
    assert source.depth == 0  # the backlog is no longer kept for c:1
    reopened.committer.add([message(8)])
    reopened.commit()
    assert source.backlog("b:1") == 1 and source.depth == 1
    reopened.close()
