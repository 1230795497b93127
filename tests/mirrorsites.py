"""Two sites for the DR mirror tests: a source broker mirroring to a mirror broker.

Real broker processes on loopback; the source's `--mirror-to` names the
mirror's `--mirror-port`. Helpers wait for the source's replication queue to
drain (every event applied on the mirror and acknowledged) through `/status`.
`reversible` sites have both ends each (the mirror can be reversed after a
switchover); the switch helpers call the admin API as an operator would.
`Ring` runs two or three bidirectional sites, each mirroring to the next
(A <-> B, or A -> B -> C -> A), optionally through fault proxies; `Mesh` runs n
bidirectional sites, each mirroring to every other (several `--mirror-to`);
`PairedMesh` is a mesh whose last site is an HA pair (active + passive).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pika
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.broker.admin_client import metric_samples, mirror_demote_call, mirror_promote_call
from twinmq.broker.api import DemotionToken, MirrorDemoteRequest, MirrorPromoteRequest, MirrorSwitch
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

TOKEN = "mirror-test-token"
ORIGIN = "site-a"


class Sites:
    """`source` (site A) mirrors to `mirror` (site B)."""

    def __init__(
        self,
        tmp: Path,
        *,
        source_args: list[str] | None = None,
        mirror_args: list[str] | None = None,
        reversible: bool = False,
        mirror_to: str | None = None,
        proxied: bool = False,
    ) -> None:
        self.mirror_port = free_port()
        # With `proxied`, the source reaches the mirror through `link` (cut, partition, heal).
        self.link = FaultProxy(f"127.0.0.1:{self.mirror_port}").start() if proxied else None
        target = self.link.address if self.link is not None else f"127.0.0.1:{self.mirror_port}"
        self.source_port = free_port()  # reversible: site A's own listener
        back_to = mirror_to or f"127.0.0.1:{self.source_port}"  # where B mirrors once promoted
        back = ["--mirror-to", back_to, "--mirror-role", "replica"]
        self.mirror = BrokerProcess(
            tmp / "b" / "data",
            name="site-b",
            extra_args=[
                "--mirror-port", str(self.mirror_port), "--mirror-token", TOKEN,
                *(back if reversible else []), *(mirror_args or []),
            ],
        )  # fmt: skip
        there = ["--mirror-port", str(self.source_port), "--mirror-role", "source"]
        self.source = BrokerProcess(
            tmp / "a" / "data",
            name="site-a-broker",
            extra_args=[
                "--mirror-to", target, "--mirror-token", TOKEN,
                "--mirror-id", ORIGIN, *(there if reversible else []), *(source_args or []),
            ],
        )  # fmt: skip

    def __enter__(self) -> Sites:
        try:
            self.mirror.start()
            try:
                self.source.start()
            except BaseException:
                self.mirror.stop()  # never leave a broker behind a failed start
                raise
        except BaseException:
            self._close_link()
            raise
        return self

    @property
    def mirror_address(self) -> str:
        """host:port of the mirror's listener."""
        return f"127.0.0.1:{self.mirror_port}"

    def __exit__(self, *exc: object) -> None:
        self.source.stop()
        self.mirror.stop()
        self._close_link()

    def _close_link(self) -> None:
        if self.link is not None:
            self.link.close()

    def caught_up(self, timeout: float = 60.0, *, source: BrokerProcess | None = None) -> None:
        """Wait until the mirror acknowledged every event the source made so far."""
        source = source or self.source
        wait_for("mirror caught up", lambda: _drained(mirror_status(source)), timeout)

    def promote_mirror(
        self, token: DemotionToken | None = None, *, force: bool = False
    ) -> MirrorSwitch:
        """`POST /mirror/promote` on site B."""
        return promote(self.mirror, token, force=force)

    def fail_over_by_force(self) -> None:
        """Site A lost (kill -9), site B (stopped: a partition) started and promoted by
        force."""
        self.source.kill()
        self.mirror.start()
        assert self.promote_mirror(force=True).forced

    def loss_counted(self) -> dict[str, Any]:
        """Site A's count of what a forced failover lost (`mirror.unmirrored`), once made
        (at the comparison's end: the promoted site's "caught up" can come a moment
        before)."""
        return wait_for("the loss counted", lambda: mirror_status(self.source)["unmirrored"], 30)

    def old_source_back(self, *, caught_up: bool = True) -> None:
        """Site A back after a forced failover: fenced by B and (`caught_up`) rebuilt by
        B's seed."""
        self.source.start()
        wait_for("A fenced", lambda: mirror_status(self.source)["role"] == "replica", 30)
        if caught_up:
            self.caught_up(source=self.mirror)


def demote(broker: BrokerProcess, timeout: float = 30.0) -> MirrorSwitch:
    """`POST /mirror/demote` on `broker`."""
    call = mirror_demote_call(MirrorDemoteRequest(timeout=timeout))
    return broker.admin.send(call, timeout + 10)


def promote(
    broker: BrokerProcess, token: DemotionToken | None = None, *, force: bool = False
) -> MirrorSwitch:
    """`POST /mirror/promote` on `broker`."""
    call = mirror_promote_call(MirrorPromoteRequest(token=token, force=force))
    return broker.admin.send(call, 40)


def mirror_status(broker: BrokerProcess) -> dict[str, Any] | None:
    """The `mirror` section of a broker's status (None if it does not answer)."""
    data = status(broker)
    return None if data is None else data["mirror"]


def all_linked(sites: list[BrokerProcess]) -> None:
    """Wait until every site's links are up (a heartbeat came back)."""
    wait_for(
        "every site linked",
        lambda: all((mirror_status(site) or {}).get("connected") for site in sites),
    )


def _drained(section: dict[str, Any] | None) -> bool:
    return section is not None and section["connected"] and section["queue_events"] == 0


def metric(broker: BrokerProcess, name: str) -> float | None:
    """One unlabelled sample of the broker's `/metrics`."""
    return metric_samples(broker.admin.metrics(timeout=5)).get(name)


def publish(broker: BrokerProcess, queue: str, bodies: list[bytes]) -> None:
    """Declare `queue` (durable) and publish persistent `bodies` with confirms."""
    connection, ch = channel(broker)
    try:
        ch.queue_declare(queue, durable=True)
        ch.confirm_delivery()
        for body in bodies:
            ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def publish_counted(
    broker: BrokerProcess, queue: str, prefix: str, n: int, confirmed: list[int]
) -> None:
    """Publish `prefix-0` .. `prefix-<n-1>` (persistent, confirmed) into `queue`, declared
    durable; each confirmed one counted in `confirmed[0]` (what a thread that died on
    the way had confirmed)."""
    connection, ch = channel(broker)
    try:
        ch.queue_declare(queue, durable=True)
        ch.confirm_delivery()
        for i in range(n):
            ch.basic_publish("", queue, f"{prefix}-{i}".encode(),
                             pika.BasicProperties(delivery_mode=2))  # fmt: skip
            confirmed[0] += 1
    finally:
        connection.close()


def take(broker: BrokerProcess, queue: str, n: int) -> int:
    """Get and acknowledge up to `n` messages of `queue`; how many there were."""
    connection, ch = channel(broker)
    taken = 0
    try:
        for _ in range(n):
            method, _props, _body = ch.basic_get(queue)
            if method is None:
                break
            ch.basic_ack(method.delivery_tag)
            taken += 1
    finally:
        connection.close()
    return taken


def channel(broker: BrokerProcess) -> tuple[pika.BlockingConnection, BlockingChannel]:
    """A pika channel on `broker`."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    return connection, connection.channel()


def queues(broker: BrokerProcess) -> dict[str, dict[str, Any]]:
    """The broker's queues by name, as `/status` lists them (internal ones left out)."""
    data = status(broker)
    assert data is not None, f"{broker.name} does not answer"
    return {q["name"]: q for q in data["queues"] if not q["name"].startswith("amq.twinmq.")}


class Ring:
    """`n` bidirectional sites (`site-a`, `site-b`, `site-c`), each mirroring to the next;
    with `proxied`, every link goes through a `FaultProxy` (`links[i]`: site i's link)."""

    def __init__(
        self, tmp: Path, n: int = 2, *, proxied: bool = False, extra_args: list[str] | None = None
    ) -> None:
        names = ["site-a", "site-b", "site-c"][:n]
        ports = [free_port() for _ in names]
        upstreams = [f"127.0.0.1:{ports[(i + 1) % n]}" for i in range(n)]
        self.links = [FaultProxy(u).start() if proxied else None for u in upstreams]
        self.sites: list[BrokerProcess] = []
        for i, name in enumerate(names):
            link = self.links[i]
            args = [
                "--mirror-port", str(ports[i]), "--mirror-token", TOKEN,
                "--mirror-to", link.address if link is not None else upstreams[i],
                "--mirror-id", name, "--mirror-role", "bidirectional", *(extra_args or []),
            ]  # fmt: skip
            self.sites.append(BrokerProcess(tmp / name / "data", name=name, extra_args=args))

    def __enter__(self) -> Ring:
        started: list[BrokerProcess] = []
        try:
            for site in self.sites:
                site.start()
                started.append(site)
        except BaseException:
            for site in started:
                site.stop()  # never leave a broker behind a failed start
            self._close_links()
            raise
        # Every link up (a heartbeat came back): each site knows whom it mirrors to, so it
        # never passes an event back to that event's origin.
        all_linked(self.sites)
        return self

    def __exit__(self, *exc: object) -> None:
        for site in self.sites:
            site.stop()
        self._close_links()

    def _close_links(self) -> None:
        for link in self.links:
            if link is not None:
                link.close()

    def caught_up(self, timeout: float = 60.0) -> None:
        """Wait until every site's mirror acknowledged everything it made or forwarded, seen
        in two passes in a row (an event forwarded between two looks is seen by the next)."""

        def all_drained() -> bool:
            return all(_drained(mirror_status(site)) for site in self.sites)

        wait_for("every site caught up", lambda: all_drained() and all_drained(), timeout)


class Mesh(Ring):
    """`n` bidirectional sites (`site-a` ...), each naming every other as a target (a full
    mesh: `--mirror-to` repeated); `extra_args` go to every site."""

    def __init__(self, tmp: Path, n: int = 3, *, extra_args: list[str] | None = None) -> None:
        names = [f"site-{chr(ord('a') + i)}" for i in range(n)]
        ports = [free_port() for _ in names]
        self.links = []
        self.sites = []
        for i, name in enumerate(names):
            targets = [
                arg for j in range(n) if j != i for arg in ("--mirror-to", f"127.0.0.1:{ports[j]}")
            ]
            args = [
                "--mirror-port", str(ports[i]), "--mirror-token", TOKEN, *targets,
                "--mirror-id", name, "--mirror-role", "bidirectional", *(extra_args or []),
            ]  # fmt: skip
            self.sites.append(BrokerProcess(tmp / name / "data", name=name, extra_args=args))

    def __enter__(self) -> Mesh:
        super().__enter__()
        return self


def browse(broker: BrokerProcess, queue: str) -> list[bytes]:
    """Every message of `queue`, left in place: consumed without acknowledging, then the
    connection closed (requeued, not settled: nothing is mirrored)."""
    connection, ch = channel(broker)
    out: list[bytes] = []
    try:
        while True:
            method, _props, body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                break
            out.append(body)
    finally:
        connection.close()
    return out


def depth(broker: BrokerProcess, queue: str) -> int | None:
    """Messages in `queue`, ready or delivered, as `/status` counts them (None: no queue)."""
    found = queues(broker).get(queue)
    return None if found is None else int(found["messages"]) + int(found["unacked"])


class PairedMesh:
    """A full mesh of `n` sites whose last (`site-c` of three) is an HA pair, brokers `c1`
    (active first) and `c2`, both with the site's settings: the other sites reach the pair's
    active through `vip` (a proxy retargeted at a failover, as a Service or a virtual IP
    moves), each of the pair's brokers listens on its own mirror port."""

    def __init__(self, tmp: Path, n: int = 3) -> None:
        names = [f"site-{chr(ord('a') + i)}" for i in range(n)]
        self.paired = names[-1]
        ports = [free_port() for _ in names[:-1]]
        self.pair_ports = {"c1": free_port(), "c2": free_port()}
        self.vip = FaultProxy(f"127.0.0.1:{self.pair_ports['c1']}")
        # The vip's port is known once it listens: the other sites name it as a target.
        self.vip.start()
        addresses = [f"127.0.0.1:{port}" for port in ports] + [self.vip.address]

        def flags(i: int) -> list[str]:
            targets = [arg for j in range(n) if j != i for arg in ("--mirror-to", addresses[j])]
            return [
                "--mirror-token", TOKEN, *targets, "--mirror-id", names[i],
                "--mirror-role", "bidirectional",
            ]  # fmt: skip

        self.singles = [
            BrokerProcess(
                tmp / name / "data",
                name=name,
                extra_args=["--mirror-port", str(ports[i]), *flags(i)],
            )
            for i, name in enumerate(names[:-1])
        ]
        self.pair = Pair(tmp / self.paired, replication_timeout=2.0, names=("c1", "c2"), link=False)
        for name, broker in self.pair.brokers.items():
            # One mirror port per broker (both on this host), so the site's settings go in
            # each broker's environment (checked there as a whole), not in shared flags.
            broker.env.update({
                "TWINMQ_MIRROR_PORT": str(self.pair_ports[name]), "TWINMQ_MIRROR_TOKEN": TOKEN,
                "TWINMQ_MIRROR_TO": ",".join(addresses[:-1]), "TWINMQ_MIRROR_ID": self.paired,
                "TWINMQ_MIRROR_ROLE": "bidirectional",
            })  # fmt: skip

    @property
    def sites(self) -> list[BrokerProcess]:
        """Each site's active broker (the pair's active last)."""
        return [*self.singles, self.pair.active]

    def __enter__(self) -> PairedMesh:
        started: list[BrokerProcess] = []
        try:
            for site in self.singles:
                site.start()
                started.append(site)
            self.pair.start()
        except BaseException:
            for site in started:
                site.stop()  # never leave a broker behind a failed start
            self.vip.close()
            raise
        all_linked(self.sites)
        return self

    def __exit__(self, *exc: object) -> None:
        for site in self.singles:
            site.stop()
        self.pair.stop()
        self.vip.close()

    def failover(self) -> None:
        """`kill -9` the pair's active; its passive, promoted, takes the `vip`; the old
        active comes back as its passive."""

        def move_vip() -> None:
            self.vip.retarget(f"127.0.0.1:{self.pair_ports[self.pair.active.name]}")

        assert self.pair.failover(on_promoted=move_vip), "the pair's passive was not ready"
        self.pair.wait_healthy(60)

    def restart_passive(self) -> None:
        """`kill -9` the pair's passive and start it again (it catches up as passive)."""
        self.pair.passive.kill()
        self.pair.passive.start()
        self.pair.wait_healthy(60)

    def caught_up(self, timeout: float = 60.0) -> None:
        """Every site's mirror acknowledged everything it made, seen twice in a row."""

        def all_drained() -> bool:
            return all(_drained(mirror_status(site)) for site in self.sites)

        wait_for("every site caught up", lambda: all_drained() and all_drained(), timeout)
