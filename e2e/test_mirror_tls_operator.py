"""A plaintext DR mirror between two BrokerClusters (two namespaces, a CA each) moved to
mutual TLS the documented way: each site's `<cluster>-ca` copied into the other's
namespace, then `spec.mirror.tls.caConfigMap` set on the replica site, then on the source.
Between the two rollouts the source holds what it cannot send; nothing is lost. And the
default: two sites naming each other, their link's TLS turned on, move to it by
themselves (each operator copies the other's CA), losing nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    create_cluster,
    drain,
    messages_in,
    publish_some,
    reasons_when,
)
from support import Cluster, new_namespace
from test_mirror_operator import connected_over_tls, mirror_secret, mirror_state, mirror_tls

from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
COUNT = 40
PEER_CA = "orders-peer-ca"


@pytest.fixture
def dr_namespace(cluster: Cluster) -> Iterator[str]:
    """A second namespace: the other site."""
    name = new_namespace(cluster, "e2e-drtls")
    yield name
    cluster.kube.delete(f"/api/v1/namespaces/{name}")


def copy_ca(cluster: Cluster, name: str, source_ns: str, target_ns: str) -> None:
    """What a user does: the other site's published CA into this namespace."""
    found: dict[str, Any] = {}

    def published() -> bool:
        found.update(cluster.kube.get(f"/api/v1/namespaces/{source_ns}/configmaps/{name}-ca")
                     or {})  # fmt: skip
        return bool((found.get("data") or {}).get("ca.crt"))

    wait_for(f"{source_ns}'s CA published", published, 60)
    body = {"metadata": {"name": PEER_CA}, "data": {"ca.crt": found["data"]["ca.crt"]}}
    cluster.kube.create(f"/api/v1/namespaces/{target_ns}/configmaps", body)


def require_tls(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.kube.patch(
        cluster_path(namespace, name), {"spec": {"mirror": {"tls": {"caConfigMap": PEER_CA}}}}
    )


def test_a_plaintext_mirror_moves_to_mutual_tls_site_by_site_losing_nothing(
    cluster: Cluster, operator: OperatorProcess, namespace: str, dr_namespace: str
) -> None:
    mirror_secret(cluster, dr_namespace)
    mirror_secret(cluster, namespace)
    replica = create_cluster(
        cluster, dr_namespace, spec={"mirror": {"role": "replica", "secretName": "orders-dr"}}
    )
    target = {"host": f"{replica}.{dr_namespace}.svc"}
    source = create_cluster(
        cluster,
        namespace,
        spec={"mirror": {"role": "source", "target": target, "secretName": "orders-dr"}},
    )
    for ns, name in ((namespace, source), (dr_namespace, replica)):
        # Each site has its mirror identity from its own CA, ready before it is used.
        found = cluster.kube.get(f"/api/v1/namespaces/{ns}/secrets/{name}-mirror-tls")
        assert found is not None and found["type"] == "kubernetes.io/tls"
    wait_for("the plaintext link up",
             lambda: mirror_state(cluster, namespace, source).get("state") == "Connected",
             60)  # fmt: skip
    source_url = amqp_url(cluster, namespace, source)
    publish_some(source_url, "orders", range(COUNT))

    copy_ca(cluster, replica, dr_namespace, namespace)
    copy_ca(cluster, source, namespace, dr_namespace)
    require_tls(cluster, dr_namespace, replica)
    wait_for("the replica site requiring TLS (the plaintext source says so)",
             lambda: "require mutual TLS" in mirror_state(cluster, namespace, source).get(
                 "message", ""), 240)  # fmt: skip
    publish_some(source_url, "orders", range(COUNT, 2 * COUNT))
    # The mirror status is read every pass: the backlog shows there before long.
    wait_for("the source holding what it cannot send",
             lambda: mirror_state(cluster, namespace, source).get("queueEvents", 0) > 0,
             60)  # fmt: skip

    require_tls(cluster, namespace, source)

    def over_tls() -> bool:
        state = mirror_state(cluster, namespace, source)
        return state.get("state") == "Connected" and bool(state.get("tls"))

    wait_for("the link up over mutual TLS", over_tls, 240)
    replica_url = amqp_url(cluster, dr_namespace, replica)
    wait_for(f"{2 * COUNT} messages on the replica site",
             lambda: messages_in(replica_url, "orders") == 2 * COUNT, 120)  # fmt: skip
    assert cluster_status(cluster, dr_namespace, replica)["mirror"].get("tls")
    assert sorted(drain(replica_url, "orders")) == list(range(2 * COUNT))


def test_a_running_plaintext_mirror_of_sites_naming_each_other_moves_to_tls_by_itself(
    cluster: Cluster, operator: OperatorProcess, namespace: str, dr_namespace: str
) -> None:
    """Two sites naming each other, TLS off on the link (as an older operator left them):
    turned on, with no CA copied by anyone, each operator copies the other's and rolls
    its pods; the messages mirrored before and after are all on the replica, once."""
    mirror_secret(cluster, dr_namespace)
    mirror_secret(cluster, namespace)

    def mirror(role: str, other: str) -> dict[str, Any]:
        return {"mirror": {"role": role, "secretName": "orders-dr", "tls": {"enabled": False},
                           "target": {"host": f"orders.{other}.svc"}}}  # fmt: skip

    replica = create_cluster(cluster, dr_namespace, spec=mirror("replica", namespace))
    source = create_cluster(cluster, namespace, spec=mirror("source", dr_namespace))
    wait_for("the plaintext link up",
             lambda: mirror_state(cluster, namespace, source).get("state") == "Connected",
             60)  # fmt: skip
    assert not mirror_state(cluster, namespace, source).get("tls")
    assert mirror_tls(cluster, namespace, source).get("reason") == "Disabled"
    source_url = amqp_url(cluster, namespace, source)
    publish_some(source_url, "orders", range(COUNT))

    for ns, name in ((dr_namespace, replica), (namespace, source)):
        cluster.kube.patch(cluster_path(ns, name),
                           {"spec": {"mirror": {"tls": {"enabled": True}}}})  # fmt: skip
    for ns, name in ((namespace, source), (dr_namespace, replica)):
        wait_for(f"{ns}'s operator copied the other site's CA",
                 lambda: mirror_tls(cluster, ns, name).get("reason") == "PeerCACopied",  # noqa: B023
                 60)  # fmt: skip
    wait_for("the link up over mutual TLS",
             lambda: connected_over_tls(cluster, namespace, source), 300)  # fmt: skip
    for ns, name in ((namespace, source), (dr_namespace, replica)):
        wait_for(f"{ns} Ready (its pods rolled)",
                 lambda: cluster_status(cluster, ns, name).get("phase") == "Ready", 240)  # noqa: B023  # fmt: skip
    reasons_when(cluster, namespace, "an Event that says the CA was copied",
                 lambda r: "MirrorPeerCACopied" in r)  # fmt: skip
    publish_some(source_url, "orders", range(COUNT, 2 * COUNT))
    replica_url = amqp_url(cluster, dr_namespace, replica)
    wait_for(f"{2 * COUNT} messages on the replica site",
             lambda: messages_in(replica_url, "orders") == 2 * COUNT, 120)  # fmt: skip
    assert cluster_status(cluster, dr_namespace, replica)["mirror"].get("tls")
    assert sorted(drain(replica_url, "orders")) == list(range(2 * COUNT))
