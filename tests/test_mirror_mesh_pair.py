"""A full mesh whose third site is an HA pair (docs/mirror.md, "Full mesh"): a `kill -9`
of the pair's active while all three sites publish with confirms; its passive takes over
with the mesh cursors and applied marks as replicated, the other sites' links reconnect to
it (the site's address moves, as a Service does). Every confirmed message ends on every
site exactly once, nothing is forwarded or loops, no target is put in NeedsResync; the
same with a `kill -9` of the pair's passive."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pika
import pytest
from mirrorsites import PairedMesh, browse, depth, metric, mirror_status, publish
from test_mirror_reseed import bodies

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)
QUEUE = "orders"


class Publisher(threading.Thread):
    """Publishes `<name>-<i>` one by one with confirms to whichever broker `target` names
    (the site's active broker), until stopped; a publish whose connection fails is
    uncertain (it may or may not have been taken) and the publisher reconnects."""

    def __init__(self, name: str, target: Callable[[], BrokerProcess]) -> None:
        super().__init__(name=f"publisher-{name}", daemon=True)
        self.prefix, self.target = name, target
        self.confirmed: list[bytes] = []
        self.uncertain: list[bytes] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._i = 0

    def run(self) -> None:
        try:
            while not self.done.is_set():
                try:
                    self._publish_until_broken()
                except (pika.exceptions.AMQPError, OSError):
                    self.done.wait(0.2)  # the site's broker is failing over: try again
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def _publish_until_broken(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.target().url))
        try:
            ch = connection.channel()
            ch.queue_declare(QUEUE, durable=True)
            ch.confirm_delivery()
            while not self.done.is_set():
                body = f"{self.prefix}-{self._i}".encode()
                self._i += 1
                try:
                    ch.basic_publish("", QUEUE, body, PERSISTENT)
                except (pika.exceptions.AMQPError, OSError):
                    self.uncertain.append(body)
                    raise
                self.confirmed.append(body)
        finally:
            if connection.is_open:
                connection.close()

    def stop(self) -> None:
        self.done.set()
        self.join(30)
        assert not self.is_alive() and self.error is None, self.error


def publishing(mesh: PairedMesh) -> list[Publisher]:
    publishers = [
        Publisher("site-a", lambda: mesh.singles[0]),
        Publisher("site-b", lambda: mesh.singles[1]),
        Publisher("site-c", lambda: mesh.pair.active),
    ]
    for publisher in publishers:
        publisher.start()
    return publishers


def flowing(publishers: list[Publisher], at_least: int) -> None:
    wait_for(
        f"{at_least} more confirms on every site",
        lambda: all(len(p.confirmed) >= at_least for p in publishers),
        60,
    )


def mid_stream(mesh: PairedMesh, action: Callable[[list[Publisher]], None]) -> list[Publisher]:
    """Every site publishing with confirms: `action` (given the publishers) after 200
    confirms each, then 200 more each; the publishers, stopped."""
    publishers = publishing(mesh)
    try:
        flowing(publishers, 200)
        action(publishers)
        flowing(publishers, max(len(p.confirmed) for p in publishers) + 200)
    finally:
        for publisher in publishers:
            publisher.stop()
    return publishers


def exactly_once_everywhere(mesh: PairedMesh, publishers: list[Publisher]) -> None:
    """Every site holds every confirmed message once, an uncertain one at most once, the
    same messages on every site, nothing forwarded or looped, no target in NeedsResync."""
    confirmed = Counter(b for p in publishers for b in p.confirmed)
    uncertain = {b for p in publishers for b in p.uncertain}

    seen: dict[str, int | None] = {}

    def same_depth() -> bool:
        seen.update({site.name: depth(site, QUEUE) for site in mesh.sites})
        depths = set(seen.values())
        return len(depths) == 1 and (depths.pop() or 0) >= len(confirmed)

    try:
        wait_for("every site at the same depth", same_depth, 120)
    except TimeoutError as exc:
        # What each site holds of each origin, for the report of a failure.
        held = {
            site.name: Counter(b.split(b"-")[1] for b in browse(site, QUEUE)) for site in mesh.sites
        }
        raise TimeoutError(
            f"{exc}; depths {seen}; confirmed {len(confirmed)}; held {held}"
        ) from None
    mesh.caught_up(120)
    held = [Counter(browse(site, QUEUE)) for site in mesh.sites]
    for site, counts in zip(mesh.sites, held, strict=True):
        twice = {body: n for body, n in counts.items() if n > 1}
        assert not twice, f"{site.name} holds duplicates: {sorted(twice)[:10]}"
        missing = set(confirmed) - set(counts)
        assert not missing, f"{site.name} lacks confirmed messages: {sorted(missing)[:10]}"
        assert set(counts) - set(confirmed) <= uncertain, f"{site.name} holds unknown messages"
    assert held[0] == held[1] == held[2]
    for site in mesh.sites:
        assert (metric(site, "twinmq_mirror_forwarded_events_total") or 0.0) == 0.0
        assert (metric(site, "twinmq_mirror_looped_events_total") or 0.0) == 0.0
        section = mirror_status(site)
        assert section is not None and section["needs_resync"] is None
        assert all(t["needs_resync"] is None for t in section["targets"]), section["targets"]


@pytest.mark.slow
def test_a_pair_as_a_mesh_site_failing_over_mid_stream_keeps_every_confirm_once_everywhere(
    tmp_path: Path,
) -> None:
    with PairedMesh(tmp_path) as mesh:
        # kill -9 of c1 with events in flight both ways
        publishers = mid_stream(mesh, lambda _: mesh.failover())
        exactly_once_everywhere(mesh, publishers)
        # c2 went on from the cursors and marks it held as c1's passive: no seed of its
        # own since it started (a seed is what a site with no record of its mesh makes).
        assert mesh.pair.active.name == "c2"
        assert mirror_status(mesh.pair.active)["last_seed"] is None


@pytest.mark.slow
def test_a_kill_9_of_the_mesh_pairs_passive_mid_stream_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    with PairedMesh(tmp_path) as mesh:

        def restart_then_fail_over(publishers: list[Publisher]) -> None:
            mesh.restart_passive()
            flowing(publishers, max(len(p.confirmed) for p in publishers) + 200)
            mesh.failover()  # the restarted passive takes over what it caught up on

        publishers = mid_stream(mesh, restart_then_fail_over)
        exactly_once_everywhere(mesh, publishers)


@pytest.mark.slow
def test_a_mesh_pairs_failover_while_a_target_is_away_keeps_that_targets_cursor(
    tmp_path: Path,
) -> None:
    with PairedMesh(tmp_path) as mesh:
        a, b = mesh.singles
        publish(mesh.pair.active, QUEUE, bodies("c-before", 50))
        mesh.caught_up()
        a.stop()  # away: the pair keeps its events for A alone, trimmed for B
        publish(mesh.pair.active, QUEUE, bodies("c-away", 200))
        publish(b, QUEUE, bodies("b-away", 100))
        wait_for("B acknowledged the pair's events", lambda: depth(b, QUEUE) == 350, 60)
        mesh.failover()  # c2 holds A's cursor and its backlog as replicated
        publish(mesh.pair.active, QUEUE, bodies("c-after", 50))
        a.start()
        expected = [
            *bodies("c-before", 50), *bodies("c-away", 200), *bodies("b-away", 100),
            *bodies("c-after", 50),
        ]  # fmt: skip
        wait_for("every site at 400", lambda: all(depth(s, QUEUE) == 400 for s in mesh.sites), 120)
        mesh.caught_up(120)
        for site in mesh.sites:
            assert sorted(browse(site, QUEUE)) == sorted(expected), site.name
            section = mirror_status(site)
            assert section is not None
            assert all(t["needs_resync"] is None for t in section["targets"]), section["targets"]
        assert mirror_status(mesh.pair.active)["last_seed"] is None
        assert mirror_status(a)["needs_resync"] is None
