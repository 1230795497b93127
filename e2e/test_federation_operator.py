"""Two BrokerClusters in two namespaces federated through the operator (spec.federation).

The downstream names the upstream BrokerCluster by reference (its virtual IP, so the link
follows the upstream pair's failovers) and a Secret with the upstream user's password; a
queue bound to the federated exchange downstream receives what is published upstream,
through a kill -9 of the upstream's active: nothing lost, nothing twice. The link runs over
amqps, as by default (`operator/federationtls.py`): the downstream verifies the upstream's
certificate against the CA the operator copied and presents a client certificate its own
CA issued; the upstream verifies it against the downstream's CA, client certificates
optional (an ordinary client presents none; a certificate of another CA is refused).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    condition,
    create_cluster,
    drain,
    events_of,
    in_sync,
    reasons_when,
    virtual_ip,
)
from support import Cluster, kubectl, new_namespace, plugin, read_pod

from twinmq.broker.names import AMQPS_PORT
from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults
from twinmq.localcluster.layout import Layout
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
TOTAL = 400
KILL_AT = TOTAL // 3


@pytest.fixture
def upstream_namespace(cluster: Cluster) -> Iterator[str]:
    """A second namespace: the central site."""
    name = new_namespace(cluster, "e2e-central")
    yield name
    cluster.kube.delete(f"/api/v1/namespaces/{name}")


def link(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """The downstream's one federation link as its status shows it ({} before)."""
    links = (cluster_status(cluster, namespace, name).get("federation") or {}).get("links")
    return dict(links[0]) if links else {}


def login_secret(cluster: Cluster, upstream_ns: str, upstream: str, namespace: str) -> None:
    """The upstream's federation user's password (`twinmq-federation`, tagged
    `federation` in its generated users file), given to the downstream's namespace (a
    Secret of another namespace cannot be mounted)."""
    secret = cluster.kube.get(f"/api/v1/namespaces/{upstream_ns}/secrets/{upstream}-auth") or {}
    body = {"metadata": {"name": "central-login"},
            "data": {"password": secret["data"]["federation-password"]}}  # fmt: skip
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", body)


def args_of(cluster: Cluster, namespace: str, pod: str) -> list[str]:
    found = read_pod(cluster.kube, namespace, pod) or {}
    containers = (found.get("spec") or {}).get("containers") or [{}]
    return list(containers[0].get("args") or [])


def trusts_downstreams(cluster: Cluster, namespace: str, name: str) -> bool:
    """Both upstream brokers rolled to optional client certificates, the pair in sync."""
    rolled = all("--tls-client-certs=optional" in args_of(cluster, namespace, f"{name}-{b}")
                 for b in ("primary", "backup"))  # fmt: skip
    status = cluster_status(cluster, namespace, name)
    done = (status.get("rollout") or {}).get("step") in (None, "Complete")
    return rolled and done and in_sync(status)


def amqps_params(
    cluster: Cluster, namespace: str, name: str, folder: Path, client: Leaf | None = None
) -> pika.ConnectionParameters:
    """The app user on the upstream's AMQPS port through its virtual IP, verifying it by
    its Service's name against its published CA; with `client`'s certificate."""
    found = cluster.kube.get(f"/api/v1/namespaces/{namespace}/configmaps/{name}-ca") or {}
    ca = folder / "ca.crt"
    ca.write_text(found["data"]["ca.crt"])
    secret = cluster.kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return pika.ConnectionParameters(
        host=virtual_ip(cluster, namespace, name), port=AMQPS_PORT,
        ssl_options=pika.SSLOptions(context, server_hostname=f"{name}.{namespace}.svc"),
        credentials=pika.PlainCredentials(data["username"], data["password"]),
        connection_attempts=1,
    )  # fmt: skip


def bind_queue(url: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.queue_declare("prices", durable=True)
    ch.queue_bind("prices", "market", "prices.#")
    conn.close()


def test_a_downstream_queue_receives_over_amqps_what_is_published_upstream_across_a_failover(
    cluster: Cluster,
    operator: OperatorProcess,
    namespace: str,
    upstream_namespace: str,
    tmp_path: Path,
) -> None:
    central = create_cluster(cluster, upstream_namespace, spec={"federation": {}})
    login_secret(cluster, upstream_namespace, central, namespace)
    fed = {
        "upstreams": [{"name": "central",
                       "clusterRef": {"name": central, "namespace": upstream_namespace},
                       "passwordSecret": {"name": "central-login"}}],
        "exchanges": [{"exchange": "market", "upstream": "central"}],
    }  # fmt: skip
    remote = create_cluster(cluster, namespace, spec={"federation": fed})
    # The upstream learns the downstream's CA and rolls (passive first, a switchover) to
    # ask for client certificates, optional.
    wait_for("the upstream trusting the downstream's CA",
             lambda: trusts_downstreams(cluster, upstream_namespace, central), 240)  # fmt: skip
    wait_for("the link running", lambda: link(cluster, namespace, remote).get("state")
             == "Running", 90)  # fmt: skip
    # Over amqps, with the copied CA and the downstream's own client certificate.
    configmaps = f"/api/v1/namespaces/{namespace}/configmaps"
    rendered = (cluster.kube.get(f"{configmaps}/{remote}-federation") or {})["data"][
        "federation.yaml"
    ]
    uri = f"amqps://twinmq-federation@{central}.{upstream_namespace}.svc:5671/"
    assert uri in rendered, rendered
    assert "tls-cert:" in rendered, rendered
    copy = cluster.kube.get(f"{configmaps}/{remote}-federation-peer-ca") or {}
    central_ca = cluster.kube.get(f"/api/v1/namespaces/{upstream_namespace}/configmaps/"
                                  f"{central}-ca") or {}  # fmt: skip
    assert copy["data"]["central.crt"] == central_ca["data"]["ca.crt"]
    assert condition(cluster_status(cluster, namespace, remote), "FederationTls") == "True"
    upstream_tls = next(c for c in cluster_status(cluster, upstream_namespace, central)[
        "conditions"] if c["type"] == "FederationTls")  # fmt: skip
    assert f"{namespace}/{remote}" in upstream_tls["message"], upstream_tls
    # The upstream's AMQPS: an ordinary client presents no certificate and logs in; one
    # presenting a certificate of a CA the upstream does not trust is refused.
    plain = pika.BlockingConnection(amqps_params(cluster, upstream_namespace, central, tmp_path))
    plain.close()
    stranger = TestCA(tmp_path / "stranger", name="stranger").issue("app", client=True)
    with pytest.raises((pika.exceptions.AMQPError, ssl.SSLError, ConnectionError)):
        pika.BlockingConnection(
            amqps_params(cluster, upstream_namespace, central, tmp_path, stranger)
        )
    remote_url = amqp_url(cluster, namespace, remote)
    bind_queue(remote_url)
    wait_for("the binding propagated upstream",
             lambda: link(cluster, namespace, remote).get("bindings") == 1, 30)  # fmt: skip
    status = cluster_status(cluster, namespace, remote)
    assert status["federation"]["serverId"] == f"{namespace}.{remote}"
    assert status["federation"]["links"][0]["upstreamServerId"] == f"{upstream_namespace}.{central}"
    assert condition(status, "Federated") == "True"

    central_url = amqp_url(cluster, upstream_namespace, central)
    # The active after the upstream's rollout (its switchover moved it).
    active = cluster_status(cluster, upstream_namespace, central)["activeBroker"]

    async def traffic() -> int:
        publisher = ReliablePublisher([central_url], reconnect_delay=0.2, give_up_after=90)
        for i in range(TOTAL):
            await publisher.publish(str(i).encode(), f"prices.{i % 7}", exchange="market",
                                    message_id=f"p-{i}")  # fmt: skip
            if i == KILL_AT:
                faults.kill_pod(Layout.default(), upstream_namespace, f"{central}-{active}",
                                "broker")  # fmt: skip
        await publisher.close()
        return publisher.reconnects

    assert asyncio.run(traffic()) >= 1  # the publisher saw the upstream's failover
    upstream = cluster_status(cluster, upstream_namespace, central)
    other = "backup" if active == "primary" else "primary"
    assert upstream["activeBroker"] == other and upstream["lastFailover"]["from"] == active

    def all_there() -> bool:
        received = link(cluster, namespace, remote).get("messagesReceived", 0)
        return int(received) >= TOTAL

    wait_for(f"{TOTAL} messages received downstream", all_there, 90)
    assert sorted(drain(remote_url, "prices")) == list(range(TOTAL)), "lost or doubled"
    wait_for("the link running again", lambda: link(cluster, namespace, remote).get("state")
             == "Running", 60)  # fmt: skip
    reasons_when(cluster, namespace, "a FederationLinkUp Event", lambda r: "FederationLinkUp" in r)
    wait_for("the upstream back in sync",
             lambda: in_sync(cluster_status(cluster, upstream_namespace, central)), 90)  # fmt: skip

    wide = kubectl(cluster, "get", "tmq", remote, "-n", namespace, "-o", "wide")
    assert wide.returncode == 0, wide.stderr
    header, row = wide.stdout.splitlines()
    # By its offset: kubectl aligns the columns, and an empty one may print nothing.
    assert row[header.index("FEDERATION") :].split()[0] == "1/1", wide.stdout
    shown = plugin(cluster, "federation", "status", "-A")
    assert shown.returncode == 0, shown.stderr
    rows = {tuple(line.split()[:6]) for line in shown.stdout.splitlines()[1:]}
    assert (namespace, remote, f"{namespace}.{remote}", "market", "central", "Running") in rows, (
        shown.stdout
    )
    assert (upstream_namespace, central, f"{upstream_namespace}.{central}", "-", "-", "-") in rows

    # The upstream's amq.peer counts: the remote link's link-up after the failover reached
    # the new active's amq.peer (received, or dropped if the link's user may not write it).
    def peer_status() -> str:
        wide = kubectl(cluster, "get", "tmq", central, "-n", upstream_namespace, "-o", "wide")
        header, row = wide.stdout.splitlines()
        return row[header.index("PEER-STATUS") :].split()[0]

    wait_for("central's Peer-Status column counting the remote's link-up",
             lambda: sum(map(int, peer_status().split("/"))) >= 1, 60)  # fmt: skip
    shown = plugin(cluster, "federation", "status", "-A")
    (central_row,) = [line.split() for line in shown.stdout.splitlines()[1:]
                      if line.split()[:2] == [upstream_namespace, central]]  # fmt: skip
    assert central_row[11] == peer_status(), shown.stdout

    # The remote given the central's server id: the operator flags the newer cluster at
    # once (from the spec, before its pods roll and its link is refused at the handshake).
    duplicate = f"{upstream_namespace}.{central}"
    cluster.kube.patch(cluster_path(namespace, remote),
                       {"spec": {"federation": {"serverId": duplicate}}})  # fmt: skip

    def flagged() -> str:
        status = cluster_status(cluster, namespace, remote)
        return str((status.get("federation") or {}).get("duplicateOf") or "")

    wait_for("the duplicate server id flagged", lambda: flagged() == f"{upstream_namespace}/"
             f"{central}", 60)  # fmt: skip
    status = cluster_status(cluster, namespace, remote)
    federated = next(c for c in status["conditions"] if c["type"] == "Federated")
    assert (federated["status"], federated["reason"]) == ("False", "DuplicateServerId")
    wait_for("the DuplicateServerId Event", lambda: "DuplicateServerId" in [
        e["reason"] for e in events_of(cluster, namespace)], 30)  # fmt: skip
    assert not (cluster_status(cluster, upstream_namespace, central).get("federation")
                or {}).get("duplicateOf")  # the older one keeps its id  # fmt: skip
