"""The mirror link's state, told honestly (docs/mirror.md, "Link state"): connected only
after a heartbeat round trip, lag per queue, and an explicit NeedsResync past the
replication queue's retention bound, between two real brokers."""

from __future__ import annotations

import time
from pathlib import Path

from mirrorsites import Sites, metric, mirror_status, publish, queues

from twinmq.broker.admin_client import metric_samples
from twinmq.testing.waiting import wait_for


def test_connected_after_a_heartbeat_and_lag_per_queue_in_events_bytes_and_seconds(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path) as sites:
        publish(sites.source, "warmup", [b"w"])
        sites.caught_up()
        section = mirror_status(sites.source)
        assert section is not None
        assert section["state"] == "connected" and section["connected"]
        assert section["round_trip_seconds"] is not None
        assert section["heartbeat_age_seconds"] is not None
        assert section["queue_lag_events"] == {}
        sites.mirror.stop()
        wait_for("link down", lambda: not mirror_status(sites.source)["connected"], 30)
        publish(sites.source, "slow", [b"s"] * 30)
        publish(sites.source, "fast", [b"f" * 10_000] * 3)  # fewer events, more bytes
        section = mirror_status(sites.source)
        assert section is not None and section["state"] == "connecting"
        lag = section["queue_lag_events"]
        assert set(lag) == {"slow", "fast"} and lag["slow"] >= lag["fast"] >= 1
        assert sum(lag.values()) <= section["queue_events"]  # + topology events
        samples = metric_samples(sites.source.admin.metrics(timeout=5))
        assert samples['twinmq_mirror_queue_lag_events{queue="slow"}'] == lag["slow"]
        # In seconds too: "slow" got its first event before "fast" did.
        seconds = section["queue_lag_seconds"]
        assert set(seconds) == {"slow", "fast"} and seconds["slow"] >= seconds["fast"] >= 0
        assert samples['twinmq_mirror_queue_lag_seconds{queue="slow"}'] >= seconds["slow"]
        # And in bytes: each queue's ops (fixed part, names, properties, body), so the
        # three 10 kB messages weigh more than the thirty 1-byte ones.
        size = section["queue_lag_bytes"]
        assert set(size) == {"slow", "fast"}
        assert size["fast"] >= 30_000 > size["slow"] >= 30 * (37 + len("slow") + 1)
        assert samples['twinmq_mirror_queue_lag_bytes{queue="fast"}'] == size["fast"]
        assert sum(size.values()) <= section["queue_bytes"]  # + each event's own header
        acked_before = samples["twinmq_mirror_event_lag_seconds_count"]
        sites.mirror.start()
        sites.caught_up()
        section = mirror_status(sites.source)
        assert section["queue_lag_events"] == {} and section["queue_lag_seconds"] == {}
        assert section["queue_lag_bytes"] == {}
        assert queues(sites.mirror)["slow"]["messages"] == 30
        # Every acknowledged event's lag went into the histogram, the backlog's among them.
        samples = metric_samples(sites.source.admin.metrics(timeout=5))
        assert samples["twinmq_mirror_event_lag_seconds_count"] >= acked_before + 33
        assert (
            samples['twinmq_mirror_event_lag_seconds_bucket{le="0.005"}']
            < (samples["twinmq_mirror_event_lag_seconds_count"])
        )  # the backlog waited for the mirror's restart


def test_a_backlog_past_its_retention_bound_is_dropped_as_needs_resync_never_silently(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path, source_args=["--mirror-retention-events", "5"]) as sites:
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "pile", [b"p"] * 20)  # one confirmed batch, one event each
        section = mirror_status(sites.source)
        assert section is not None and section["state"] == "needs-resync"
        assert "retention bound" in (section["needs_resync"] or "")
        assert section["queue_events"] == 0
        assert metric(sites.source, "twinmq_mirror_needs_resync") == 1
        sites.source.stop()
        sites.source.start()  # durable: a restart does not hide it
        section = mirror_status(sites.source)
        assert section is not None and section["state"] == "needs-resync"
        sites.mirror.start()
        assert not mirror_status(sites.source)["connected"]  # no link: it would diverge
        assert "pile" not in queues(sites.mirror)  # its declare event went with the backlog


def test_a_mirror_in_a_resource_alarm_applies_nothing_says_so_and_never_slows_producers(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path, source_args=["--mirror-max-lag", "1"]) as sites:
        publish(sites.source, "orders", [b"before"])
        sites.caught_up()
        sites.mirror.stop()
        # More free disk asked for than any disk has: the mirror's disk alarm is raised.
        sites.mirror.extra_args += ["--disk-free-limit", str(1 << 60)]
        sites.mirror.start()
        wait_for(
            "the source hears the mirror is blocked",
            lambda: mirror_status(sites.source)["mirror_blocked"] == "disk",
            30,
        )
        publish(sites.source, "orders", [b"x"] * 10)
        time.sleep(2.5)  # past --mirror-max-lag: a consuming mirror would block producers
        publish(sites.source, "orders", [b"y"] * 10)  # confirmed: producers not blocked
        section = mirror_status(sites.source)
        assert not section["flow_control"] and section["queue_events"] >= 20
        assert queues(sites.mirror)["orders"]["messages"] == 1  # nothing applied meanwhile
        sites.mirror.stop()
        sites.mirror.extra_args = sites.mirror.extra_args[:-2]  # room again
        sites.mirror.start()
        sites.caught_up()
        assert mirror_status(sites.source)["mirror_blocked"] is None
        assert queues(sites.mirror)["orders"]["messages"] == 21
