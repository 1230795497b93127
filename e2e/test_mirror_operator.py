"""Two BrokerClusters in two namespaces, one the DR mirror of the other (spec.mirror), or
both writable mirroring each other (role bidirectional); three in a full mesh.

The source's active reaches the replica's active through the replica's virtual-IP
Service (its mirror port); confirmed traffic through the source's virtual IP arrives on
the replica, and both statuses say how the link stands.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_status,
    create_cluster,
    drain,
    messages_in,
    publish_some,
    virtual_ip,
)
from support import Cluster, new_namespace, plugin

from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults
from twinmq.localcluster.layout import Layout
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
TOKEN = base64.b64encode(b"a-shared-mirror-token").decode()
COUNT = 60


@pytest.fixture
def dr_namespace(cluster: Cluster) -> Iterator[str]:
    """A second namespace: the other site."""
    name = new_namespace(cluster, "e2e-dr")
    yield name
    cluster.kube.delete(f"/api/v1/namespaces/{name}")


def mirror_secret(cluster: Cluster, namespace: str) -> None:
    body = {"metadata": {"name": "orders-dr"}, "data": {"mirror-token": TOKEN}}
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", body)


def mirror_state(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    state: dict[str, Any] = cluster_status(cluster, namespace, name).get("mirror") or {}
    return state


def connected(cluster: Cluster, namespace: str, name: str) -> bool:
    return mirror_state(cluster, namespace, name).get("state") == "Connected"


def mirror_tls(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """The `MirrorTls` condition: whether the brokers are built for mutual TLS, and why."""
    conditions = cluster_status(cluster, namespace, name).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "MirrorTls"), {})


def connected_over_tls(cluster: Cluster, namespace: str, name: str) -> bool:
    state = mirror_state(cluster, namespace, name)
    return state.get("state") == "Connected" and bool(state.get("tls"))


def test_confirmed_traffic_through_the_source_arrives_on_the_replica_site(
    cluster: Cluster, operator: OperatorProcess, namespace: str, dr_namespace: str
) -> None:
    mirror_secret(cluster, dr_namespace)
    mirror_secret(cluster, namespace)
    replica = create_cluster(
        cluster, dr_namespace, spec={"mirror": {"role": "replica", "secretName": "orders-dr"}}
    )
    target = {"host": virtual_ip(cluster, dr_namespace, replica)}
    source = create_cluster(
        cluster,
        namespace,
        spec={"mirror": {"role": "source", "target": target, "secretName": "orders-dr"}},
    )
    wait_for("the source says Connected", lambda: connected(cluster, namespace, source), 60)
    # A target given by address: the operator cannot learn the other site's CA, and says
    # so (the link runs plaintext with its token; `kubectl twinmq mirror trust` fixes it).
    why = mirror_tls(cluster, namespace, source)
    assert why.get("status") == "False" and why.get("reason") == "PeerCAUnknown", why
    assert "mirror trust" in why.get("message", ""), why
    publish_some(amqp_url(cluster, namespace, source), "orders", range(COUNT))

    replica_url = amqp_url(cluster, dr_namespace, replica)
    wait_for(f"{COUNT} messages on the replica site",
             lambda: messages_in(replica_url, "orders") == COUNT, 60)  # fmt: skip
    wait_for("the replica says a source is linked",
             lambda: connected(cluster, dr_namespace, replica), 30)  # fmt: skip
    seen = mirror_state(cluster, namespace, source)
    assert seen["role"] == "source" and "lagSeconds" in seen and "queueEvents" in seen
    shown = plugin(cluster, "mirror", "status", "-A")
    assert shown.returncode == 0, shown.stderr
    rows = {tuple(line.split()[:4]) for line in shown.stdout.splitlines()[1:]}
    assert (namespace, source, "source", "Connected") in rows, shown.stdout
    assert (dr_namespace, replica, "replica", "Connected") in rows, shown.stdout
    # A declared re-seed (the way out of NeedsResync) rebuilds the replica: nothing in
    # it changes, nothing is orphaned, and the link is up again.
    shown = plugin(cluster, "mirror", "reseed", source, "-n", namespace, "--timeout", "60")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"a seed of {COUNT} messages" in shown.stdout, shown.stdout
    wait_for("the source says Connected", lambda: connected(cluster, namespace, source), 60)
    wait_for("the seed applied", lambda: mirror_state(cluster, namespace, source).get(
        "queueEvents") == 0, 60)  # fmt: skip
    assert mirror_state(cluster, dr_namespace, replica).get("orphans", 0) == 0
    assert sorted(drain(replica_url, "orders")) == list(range(COUNT))


def test_a_declared_switchover_makes_the_replica_site_the_source_losing_nothing(
    cluster: Cluster, operator: OperatorProcess, namespace: str, dr_namespace: str
) -> None:
    """Both sites switchable (each names the other by its virtual IP's DNS name):
    `kubectl twinmq mirror switchover` demotes the source (drained), promotes the replica
    with its token; the new source's traffic then flows back to the old one; then
    `kubectl twinmq mirror failback` makes the old source the source again."""
    mirror_secret(cluster, dr_namespace)
    mirror_secret(cluster, namespace)

    def mirror(role: str, other: str) -> dict[str, Any]:
        return {"mirror": {"role": role, "secretName": "orders-dr",
                           "target": {"host": f"orders.{other}.svc"}}}  # fmt: skip

    replica = create_cluster(cluster, dr_namespace, spec=mirror("replica", namespace))
    source = create_cluster(cluster, namespace, spec=mirror("source", dr_namespace))
    # No TLS field in either spec: each operator copies the other site's CA (the site
    # created first rolls its pods once it is published) and the link runs mutual TLS.
    wait_for("the source Connected over mutual TLS",
             lambda: connected_over_tls(cluster, namespace, source), 240)  # fmt: skip
    for ns, name in ((namespace, source), (dr_namespace, replica)):
        why = mirror_tls(cluster, ns, name)
        assert why.get("status") == "True" and why.get("reason") == "PeerCACopied", why
        # A switchover asked in the middle of a site's rolling update would race it.
        wait_for(f"{ns} Ready (its pods rolled)",
                 lambda: cluster_status(cluster, ns, name).get("phase") == "Ready", 240)  # noqa: B023  # fmt: skip
    publish_some(amqp_url(cluster, namespace, source), "orders", range(COUNT))

    shown = plugin(cluster, "mirror", "switchover", source, f"{dr_namespace}/{replica}",
                   "-n", namespace, "--timeout", "120")  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "promoted" in shown.stdout, shown.stdout
    assert mirror_state(cluster, namespace, source)["role"] == "replica"

    new_source = amqp_url(cluster, dr_namespace, replica)
    publish_some(new_source, "orders", range(COUNT, COUNT + 10))
    old_source = amqp_url(cluster, namespace, source)
    wait_for("the new source's messages mirrored back to the old one",
             lambda: messages_in(old_source, "orders") == COUNT + 10, 60)  # fmt: skip
    # Failback in one command: the site that is the source now is named by the old
    # source's target; it waits until in sync, is demoted, and the old source is
    # promoted with its token (docs/mirror.md, "Failback as one command").
    shown = plugin(cluster, "mirror", "failback", source, "-n", namespace, "--timeout", "120")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    print(shown.stdout)  # its phases and time, for docs/mirror.md
    assert f"failed back to {namespace}/{source}" in shown.stdout, shown.stdout
    wait_for("the old source is the source again",
             lambda: mirror_state(cluster, namespace, source)["role"] == "source", 30)  # fmt: skip
    assert mirror_state(cluster, dr_namespace, replica)["role"] == "replica"
    failback = mirror_state(cluster, dr_namespace, replica)["failback"]
    assert failback["phase"] == "Done", failback
    publish_some(old_source, "orders", range(COUNT + 10, COUNT + 20))
    wait_for("the old source's messages mirrored to the other site again",
             lambda: messages_in(new_source, "orders") == COUNT + 20, 60)  # fmt: skip
    assert mirror_state(cluster, namespace, source).get("tls"), "switched back over TLS"
    assert sorted(drain(old_source, "orders")) == list(range(COUNT + 20))


def browse(url: str, queue: str) -> list[int]:
    """Every message of `queue`, left in place: taken unacknowledged, then the connection
    closed (requeued, never settled: nothing is mirrored to the other site)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    seen: list[int] = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=False)
        if method is None:
            break
        seen.append(int(body))
    conn.close()
    return seen


def both_ways(cluster: Cluster, namespace: str, name: str) -> bool:
    state = mirror_state(cluster, namespace, name)
    return state.get("state") == "Connected" and state.get("inbound") == "Connected"


async def confirmed_traffic(
    url: str, first: int, count: int, kill: tuple[str, str] | None = None
) -> int:
    """Publish `first`..`first + count` as confirmed messages to `orders` through `url`
    (a reliable publisher: re-sent under their ids across a failover); with `kill`
    (namespace, pod), `kill -9` that broker a third of the way through. Returns the
    number confirmed."""
    publisher = ReliablePublisher([url], reconnect_delay=0.2, give_up_after=90)
    sent = 0
    for i in range(first, first + count):
        await publisher.publish(str(i).encode(), "orders", message_id=f"o-{i}")
        sent += 1
        if kill is not None and i == first + count // 3:
            faults.kill_pod(Layout.default(), kill[0], kill[1], "broker")
    await publisher.close()
    return sent


def test_two_bidirectional_sites_both_writable_keep_every_confirmed_message_once_through_a_failover(
    cluster: Cluster, operator: OperatorProcess, namespace: str, dr_namespace: str
) -> None:
    """Two BrokerClusters each naming the other (role bidirectional): confirmed traffic
    through both virtual IPs at once, and `kill -9` of one site's active broker in the
    middle of it (its pair fails over, both links reconnect through the virtual IPs).
    Every confirmed message of either site is then on both sites exactly once."""
    mirror_secret(cluster, dr_namespace)
    mirror_secret(cluster, namespace)

    def mirror(other: str) -> dict[str, Any]:
        return {"mirror": {"role": "bidirectional", "secretName": "orders-dr",
                           "target": {"host": f"orders.{other}.svc"}}}  # fmt: skip

    site_b = create_cluster(cluster, dr_namespace, spec=mirror(namespace))
    site_a = create_cluster(cluster, namespace, spec=mirror(dr_namespace))
    for ns, name in ((namespace, site_a), (dr_namespace, site_b)):
        # Over mutual TLS by default (the site made first rolls once it has the other's CA).
        wait_for(f"{ns} linked both ways over TLS",
                 lambda: both_ways(cluster, ns, name) and connected_over_tls(cluster, ns, name),  # noqa: B023
                 240)  # fmt: skip
    url_a, url_b = amqp_url(cluster, namespace, site_a), amqp_url(cluster, dr_namespace, site_b)
    publish_some(url_a, "orders", range(0))  # the queue, declared on A, mirrored to B
    wait_for("the queue on site B", lambda: messages_in(url_b, "orders") == 0, 60)
    shown = plugin(cluster, "mirror", "status", "-A")
    rows = {tuple(line.split()[:5]) for line in shown.stdout.splitlines()[1:]}
    for ns, name in ((namespace, site_a), (dr_namespace, site_b)):
        assert (ns, name, "bidirectional", "Connected", "Connected") in rows, shown.stdout

    per_site = 300

    async def both_sites() -> list[int]:
        return list(await asyncio.gather(
            confirmed_traffic(url_a, 0, per_site, (namespace, f"{site_a}-primary")),
            confirmed_traffic(url_b, per_site, per_site),
        ))  # fmt: skip

    assert asyncio.run(both_sites()) == [per_site, per_site]
    assert cluster_status(cluster, namespace, site_a)["activeBroker"] == "backup"
    total = 2 * per_site
    for url in (url_a, url_b):
        wait_for(f"{total} messages on {url.rsplit('@', 1)[-1]}",
                 lambda: messages_in(url, "orders") == total, 120)  # noqa: B023  # fmt: skip
    for ns, name in ((namespace, site_a), (dr_namespace, site_b)):
        wait_for(f"{ns} linked both ways again", lambda: both_ways(cluster, ns, name), 90)  # noqa: B023
        wait_for(f"{ns} has nothing left to mirror",
                 lambda: mirror_state(cluster, ns, name).get("queueEvents") == 0, 60)  # noqa: B023  # fmt: skip
    assert sorted(browse(url_a, "orders")) == list(range(total)), "lost or duplicated on A"
    assert sorted(browse(url_b, "orders")) == list(range(total)), "lost or duplicated on B"


@pytest.fixture
def third_namespace(cluster: Cluster) -> Iterator[str]:
    """A third namespace: the mesh's third site."""
    name = new_namespace(cluster, "e2e-dr3")
    yield name
    cluster.kube.delete(f"/api/v1/namespaces/{name}")


def test_three_sites_in_a_full_mesh_keep_every_confirmed_message_once_on_each_through_a_failover(
    cluster: Cluster,
    operator: OperatorProcess,
    namespace: str,
    dr_namespace: str,
    third_namespace: str,
) -> None:
    """Three BrokerClusters, each naming the two others (`spec.mirror.targets`): linked
    over mutual TLS once each operator knows every target's CA; confirmed traffic through
    the three virtual IPs at once with `kill -9` of one site's active in the middle (its
    pair fails over, every link reconnects through the virtual IPs). Every confirmed
    message of every site is then on each of the three exactly once."""
    sites = (namespace, dr_namespace, third_namespace)
    for ns in sites:
        mirror_secret(cluster, ns)

    def mesh(me: str) -> dict[str, Any]:
        targets = [{"host": f"orders.{other}.svc"} for other in sites if other != me]
        return {"mirror": {"role": "bidirectional", "secretName": "orders-dr",
                           "targets": targets}}  # fmt: skip

    names = {ns: create_cluster(cluster, ns, spec=mesh(ns)) for ns in reversed(sites)}
    for ns, name in names.items():
        wait_for(f"{ns} linked to both targets and from both over TLS",
                 lambda: both_ways(cluster, ns, name) and connected_over_tls(cluster, ns, name),  # noqa: B023
                 300)  # fmt: skip
        targets = mirror_state(cluster, ns, name).get("targets") or []
        assert sorted(t.get("state") for t in targets) == ["Connected", "Connected"], targets
    urls = [amqp_url(cluster, ns, names[ns]) for ns in sites]
    publish_some(urls[0], "orders", range(0))  # the queue, declared on one site, mirrored
    for url in urls[1:]:
        wait_for("the queue on every site", lambda: messages_in(url, "orders") == 0, 60)  # noqa: B023

    per_site = 200
    victim = (namespace, f"{names[namespace]}-primary")

    async def three_sites() -> list[int]:
        return list(await asyncio.gather(*(
            confirmed_traffic(url, i * per_site, per_site, victim if i == 0 else None)
            for i, url in enumerate(urls)
        )))  # fmt: skip

    assert asyncio.run(three_sites()) == [per_site] * 3
    assert cluster_status(cluster, namespace, names[namespace])["activeBroker"] == "backup"
    total = 3 * per_site
    for url in urls:
        wait_for(f"{total} messages on {url.rsplit('@', 1)[-1]}",
                 lambda: messages_in(url, "orders") == total, 180)  # noqa: B023  # fmt: skip
    for ns, name in names.items():
        wait_for(f"{ns} has nothing left to mirror",
                 lambda: both_ways(cluster, ns, name)  # noqa: B023
                 and mirror_state(cluster, ns, name).get("queueEvents") == 0, 120)  # noqa: B023  # fmt: skip
    for ns, url in zip(sites, urls, strict=True):
        assert sorted(browse(url, "orders")) == list(range(total)), f"lost or twice on {ns}"
