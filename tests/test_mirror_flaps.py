"""The DR mirror across many link flaps under traffic: partitions and cuts of the link, in
random order and length, while a publisher keeps confirming and a consumer settles some of
what it published. After the last heal both sites hold exactly the same messages, each
once, and every confirmed message not settled is there.

Real broker processes, the link through a `FaultProxy` on loopback. `make test` runs a few
cycles; `make soak` runs TWINMQ_FLAP_CYCLES (100 by default), one-way and bidirectional.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pika
import pytest
from mirrorsites import Ring, Sites, browse, channel, mirror_status

from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess

QUEUE = "flaps"
PERSISTENT = pika.BasicProperties(delivery_mode=2)
SOAK_CYCLES = int(os.environ.get("TWINMQ_FLAP_CYCLES", "100"))


class Traffic(threading.Thread):
    """Confirmed publishes to one site, one at a time, until stopped; every third message
    taken back and acknowledged (a settle the mirror must apply too)."""

    def __init__(self, site: BrokerProcess, prefix: str) -> None:
        super().__init__(daemon=True, name=f"traffic-{prefix}")
        self.site, self.prefix = site, prefix
        self.stop = threading.Event()
        self.confirmed: set[bytes] = set()
        self.settled: set[bytes] = set()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            connection, ch = channel(self.site)
            ch.queue_declare(QUEUE, durable=True)
            ch.confirm_delivery()
            n = 0
            while not self.stop.is_set():
                body = f"{self.prefix}-{n}".encode()
                ch.basic_publish("", QUEUE, body, PERSISTENT)  # returns once confirmed
                self.confirmed.add(body)
                n += 1
                if n % 3 == 0:
                    method, _props, got = ch.basic_get(QUEUE, auto_ack=False)
                    if method is not None:
                        ch.basic_ack(method.delivery_tag)
                        self.settled.add(got)
            connection.close()
        except BaseException as exc:  # reported by the test, never swallowed
            self.error = exc


def flap(links: list[FaultProxy], cycles: int, rng: random.Random) -> None:
    """`cycles` faults on random links: a cut (connections reset) or a partition (bytes
    held), each healed after a random while."""
    for _ in range(cycles):
        time.sleep(rng.uniform(0.05, 0.3))
        hit = [link for link in links if rng.random() < 0.7] or [rng.choice(links)]
        fault: Callable[[FaultProxy], None] = rng.choice([FaultProxy.cut, FaultProxy.partition])
        for link in hit:
            fault(link)
        time.sleep(rng.uniform(0.05, 0.5))
        for link in hit:
            link.heal()


def run_traffic(sites: list[BrokerProcess], links: list[FaultProxy], cycles: int) -> set[bytes]:
    """Traffic on every site while the links flap; the messages that must remain."""
    traffic = [Traffic(site, site.name) for site in sites]
    for t in traffic:
        t.start()
    try:
        flap(links, cycles, random.Random(cycles))
    finally:
        for t in traffic:
            t.stop.set()
        for t in traffic:
            t.join(60)
    for t in traffic:
        assert t.error is None, f"{t.name}: {t.error!r}"
        assert len(t.confirmed) > cycles, f"{t.name}: only {len(t.confirmed)} confirmed"
    remaining: set[bytes] = set()
    for t in traffic:
        remaining |= t.confirmed
    for t in traffic:
        remaining -= t.settled
    return remaining


def assert_same_once(sites: list[BrokerProcess], remaining: set[bytes]) -> None:
    """Every site holds exactly `remaining`, each message once."""
    for site in sites:
        held = browse(site, QUEUE)
        assert len(held) == len(set(held)), f"{site.name}: {len(held) - len(set(held))} twice"
        missing, extra = remaining - set(held), set(held) - remaining
        assert not missing and not extra, (
            f"{site.name}: {len(missing)} confirmed messages missing {sorted(missing)[:5]}, "
            f"{len(extra)} settled or unknown ones still there {sorted(extra)[:5]}"
        )


def caught_up(wait: Callable[[], None], sites: list[BrokerProcess]) -> None:
    """`wait`, and on a timeout what each site's mirror status says (why it is not)."""
    try:
        wait()
    except TimeoutError as exc:
        seen = {site.name: mirror_status(site) for site in sites}
        raise AssertionError(f"{exc}; mirror status: {seen}; logs: "
                             f"{[str(site.log_path) for site in sites]}") from exc  # fmt: skip


def one_way(tmp_path: Path, cycles: int) -> None:
    with Sites(tmp_path, proxied=True) as sites:
        assert sites.link is not None
        remaining = run_traffic([sites.source], [sites.link], cycles)
        caught_up(lambda: sites.caught_up(timeout=120), [sites.source, sites.mirror])
        assert_same_once([sites.source, sites.mirror], remaining)


def both_ways(tmp_path: Path, cycles: int) -> None:
    with Ring(tmp_path, 2, proxied=True) as ring:
        links = [link for link in ring.links if link is not None]
        remaining = run_traffic(ring.sites, links, cycles)
        caught_up(lambda: ring.caught_up(timeout=120), ring.sites)
        assert_same_once(ring.sites, remaining)


class ActiveSource:
    """The part of `MirrorSource` the link's reconnect loop reads."""

    on_change: Callable[[], None] | None = None

    def ensure_active(self) -> bool:
        return True


@pytest.mark.parametrize(
    "failure",
    [
        # What uvloop raises for a write to a transport a cut just reset (found by the
        # soak below: the link stopped reconnecting for good).
        RuntimeError("unable to perform operation on <TCPTransport closed=True>"),
        KeyError("a bug"),
    ],
)
def test_the_mirror_link_reconnects_after_any_failure_of_a_session(failure: Exception) -> None:
    from twinmq.broker.mirror.link import MirrorLink

    async def scenario() -> list[int]:
        link = MirrorLink(ActiveSource(), "127.0.0.1:9", "key", "site-a", retry=0.01)  # type: ignore[arg-type]
        sessions: list[int] = []
        again = asyncio.Event()

        async def session() -> None:
            sessions.append(len(sessions))
            if len(sessions) == 1:
                raise failure
            again.set()
            await asyncio.sleep(3600)

        link._session = session  # type: ignore[method-assign]
        link.start()
        await asyncio.wait_for(again.wait(), 10)
        assert link.last_error is not None and not link.connected
        await link.stop()
        return sessions

    assert asyncio.run(scenario()) == [0, 1]


def test_a_one_way_mirror_through_link_flaps_under_traffic_ends_exactly_as_its_source(
    tmp_path: Path,
) -> None:
    one_way(tmp_path, 8)


def test_two_bidirectional_sites_through_link_flaps_under_traffic_end_identical(
    tmp_path: Path,
) -> None:
    both_ways(tmp_path, 8)


@pytest.mark.soak
def test_a_one_way_mirror_survives_a_hundred_partitions_and_cuts_under_traffic(
    tmp_path: Path,
) -> None:
    one_way(tmp_path, SOAK_CYCLES)


@pytest.mark.soak
def test_two_bidirectional_sites_survive_a_hundred_partitions_and_cuts_under_traffic(
    tmp_path: Path,
) -> None:
    both_ways(tmp_path, SOAK_CYCLES)
