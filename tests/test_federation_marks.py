"""The upstream tells its link, per origin, how far it will ever forward (real brokers).

A diamond A -> B -> D and A -> C -> D: D's `sink` is bound to everything from B and only
to `c.#` from C, so C's link never brings A's `a.*` messages (C binds only `c.#` at A).
Before marks, D's window waited for C's link for every origin, and kept each of A's
keys (a bit each) until its bound; now C tells D how far A (and itself) have got, and D
lets them go (docs/federation.md, "The upstream tells its marks")."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from federationsites import (
    channel,
    federation_file,
    get_all,
    links,
    publish_confirmed,
    site,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.federation.agent import queue_name
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

WINDOW = 500
# A link's own marks are in force 4,096 keys after it brought them (agent.py): D keeps
# up to that many of B's last keys whatever it is told, plus its newest `WINDOW`.
BOUND = WINDOW + 4096 + 1024
LATE = 3 * BOUND  # A's messages C never carries: before, D kept every one of them
OLD_PEER = {"TWINMQ_FEDERATION_MARKS": "0"}  # a broker as the versions before marks


@dataclass
class Diamond:
    """Started A, B, C, D; D's links through `to_b` and `to_c`."""

    a: BrokerProcess
    b: BrokerProcess
    c: BrokerProcess
    d: BrokerProcess
    to_b: FaultProxy
    to_c: FaultProxy

    def held(self) -> int:
        """Keys D's dedup window holds (the newest and the compacted ones)."""
        return int(links(self.d)["t"]["dedup_keys"])

    def forced(self) -> float:
        """Keys D's window forgot at its bound while a link had not passed them."""
        samples = metric_samples(self.d.admin.metrics(timeout=5))
        return samples.get("twinmq_federation_dedup_forced_total", 0.0)


@contextmanager
def diamond(tmp_path: Path, old: tuple[str, ...] = ()) -> Iterator[Diamond]:
    """The diamond of the module, started, every binding propagated; the brokers named in
    `old` behave as versions before marks. Every broker stopped after."""
    a, b, c, d = (site(tmp_path, name) for name in "abcd")
    for name, broker in zip("abcd", (a, b, c, d), strict=True):
        if name in old:
            broker.env.update(OLD_PEER)
    fed = {"type": "topic", "max-hops": 3}
    for broker in (b, c):
        broker.extra_args += [
            "--federation-config",
            str(
                federation_file(
                    tmp_path / f"{broker.name}.json",
                    {"a": f"127.0.0.1:{a.port}"},
                    [{"exchange": "t", "upstream": "a", **fed}],
                )
            ),
        ]
    with (
        FaultProxy(f"127.0.0.1:{b.port}") as to_b,
        FaultProxy(f"127.0.0.1:{c.port}") as to_c,
    ):
        d.extra_args += [
            "--federation-config",
            str(
                federation_file(
                    tmp_path / "d.json",
                    {"b": to_b.address, "c": to_c.address},
                    [
                        {"exchange": "t", "upstream": "b", **fed},
                        {"exchange": "t-via-c", "upstream": "c", "upstream-exchange": "t", **fed},
                    ],
                    {"dedup-window": WINDOW},
                )
            ),
        ]
        for broker in (a, b, c, d):
            broker.start()
        try:
            for broker, exchange in ((b, "t"), (c, "t"), (d, "t"), (d, "t-via-c")):
                wait_running(broker, exchange)
            connection, ch = channel(d)
            ch.queue_declare("sink", durable=True)
            ch.queue_bind("sink", "t", "#")
            ch.queue_bind("sink", "t-via-c", "c.#")
            connection.close()
            wait_upstream_bindings(b, queue_name("t", "d"), {("t", "#")})
            wait_upstream_bindings(c, queue_name("t", "d"), {("t", "c.#")})
            wait_upstream_bindings(a, queue_name("t", "b"), {("t", "#")})
            wait_upstream_bindings(a, queue_name("t", "c"), {("t", "c.#")})
            yield Diamond(a, b, c, d, to_b, to_c)
        finally:
            for broker in (d, c, b, a):
                broker.stop()


def run(shape: Diamond, flaps: bool = False) -> list[str]:
    """A's `c.*` messages (both paths), C's own, then `LATE` of A's `a.*` messages (by B
    only), in chunks, D's links cut between chunks if `flaps`. Every confirmed message
    must be in D's `sink` once; the bodies taken from it."""
    expected: list[str] = []

    def publish(broker: BrokerProcess, key: str, label: str, count: int) -> None:
        bodies = [f"{label}-{len(expected) + i}" for i in range(count)]
        publish_confirmed(broker, "t", [(key, body.encode()) for body in bodies])
        expected.extend(bodies)

    publish(shape.a, "c.a", "a", 100)  # reach D by B and by C: one copy dropped
    publish(shape.c, "c.own", "c", 200)
    for chunk in range(10):
        publish(shape.a, "a.x", "a", LATE // 10)
        if flaps and chunk % 3 == 0:
            shape.to_b.cut()
            shape.to_c.cut()
            shape.to_b.heal()
            shape.to_c.heal()
        if chunk == 5:
            publish(shape.a, "c.a", "a", 50)  # both paths again, midway
    got = [body.decode() for _key, body, _h in get_all(shape.d, "sink", len(expected), 120)]
    counts = collections.Counter(got)
    assert [body for body, n in counts.items() if n > 1] == []  # 0 delivered twice
    assert sorted(counts) == sorted(expected)  # 0 lost
    return got


@pytest.mark.slow
def test_a_link_that_never_brings_an_origin_no_longer_holds_its_keys(tmp_path: Path) -> None:
    """C's link brings none of A's `a.*` messages; C tells D how far A has got (what A
    told C: its own IDs), so D's window lets A's keys go once B's link has passed them:
    the keys held fall within the newest `WINDOW` and B's last 4,096, nothing forced.
    Before (main's federation code): D held every one of A's `LATE` keys."""
    with diamond(tmp_path) as shape:
        run(shape)
        wait_for("D's held keys within the bound", lambda: shape.held() <= BOUND, 60)
        assert shape.forced() == 0


@pytest.mark.soak  # minutes each: `make soak` (make test keeps the core marks test)
def test_link_flaps_keep_every_message_once_and_the_held_keys_bounded(tmp_path: Path) -> None:
    """The same with D's two links cut and reconnected every third chunk: what was told
    before a cut holds no more after it, a cut's re-deliveries are never passed by a told
    mark, 0 lost, 0 twice, and the held keys still fall within the bound."""
    with diamond(tmp_path) as shape:
        run(shape, flaps=True)
        wait_for("D's held keys within the bound", lambda: shape.held() <= BOUND, 60)
        assert shape.forced() == 0


@pytest.mark.soak  # minutes each: `make soak` (make test keeps the core marks test)
@pytest.mark.parametrize("old", ["c", "d"], ids=["old-upstream", "old-downstream"])
def test_a_peer_without_marks_still_federates_every_message_once(tmp_path: Path, old: str) -> None:
    """C (an upstream) or D (a downstream) as a version before marks: no marks asked for
    or sent (the link asks only an upstream that announced them, an upstream tells only a
    link that asked), every message once, and D waits for C's link for A's keys as before:
    it holds them all."""
    with diamond(tmp_path, old=(old,)) as shape:
        run(shape)
        assert shape.held() > LATE  # every `a.*` key still waits for C's link
        assert shape.forced() == 0
