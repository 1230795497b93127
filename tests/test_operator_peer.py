"""Each broker pod names its one peer (`--peer`, issue 16): the other pod's stable name
through the headless Service, whose certificate (operator/certs.py) carries that name and
the pod name the passive already checks. The pods are created on the real API server and
read back; their arguments are what the broker parses."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from twinmq.broker.names import (
    ADMIN_TOKEN_ENV,
    REPLICATION_PORT,
    REPLICATION_TOKEN_ENV,
    setting_env,
)
from twinmq.broker.settings import parse_args
from twinmq.operator import certs
from twinmq.operator.builders import ClusterRef, build_pod, other_broker
from twinmq.operator.kube import Kube
from twinmq.operator.models import BrokerClusterSpec, BrokerName

NAMESPACES = (f"peers-{n}" for n in itertools.count())


def created(kube: Kube, cluster: ClusterRef, broker: BrokerName) -> dict[str, Any]:
    """The broker's pod (the last step of the move to mutual TLS), as the API server keeps it."""
    pod = build_pod(cluster, BrokerClusterSpec(), broker, peer_tls="Required")
    kube.core.create_namespaced_pod(cluster.namespace, pod)
    found = kube.get("v1", "Pod", cluster.namespace, pod["metadata"]["name"])
    assert found is not None
    return found


def test_each_pod_names_the_other_pod_as_its_peer_by_a_name_its_certificate_carries(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = next(NAMESPACES)
    kube.core.create_namespace({"metadata": {"name": namespace}})
    cluster = ClusterRef(namespace=namespace, name="orders", uid="u-1")
    kube.core.create_namespaced_service_account(namespace, {"metadata": {"name": "orders-broker"}})
    # The broker reads its tokens from the environment (the pod's Secret references).
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "admin")
    monkeypatch.setenv(REPLICATION_TOKEN_ENV, "replication")
    monkeypatch.setenv(setting_env("data_dir"), "/tmp/unused")
    brokers: tuple[BrokerName, ...] = ("primary", "backup")
    for broker in brokers:
        other = other_broker(broker)
        pod = created(kube, cluster, broker)
        args = pod["spec"]["containers"][0]["args"]
        peer = f"orders-{other}.orders-brokers.{namespace}.svc:{REPLICATION_PORT}"
        assert f"--peer={peer}" in args
        settings = parse_args([a.replace("$(POD_NAME)", f"orders-{broker}") for a in args])
        assert settings.replication_peer is not None
        assert str(settings.replication_peer) == peer
        # Over mutual TLS each end requires the other's certificate to name the other pod;
        # the operator issues it that name and the peer's host.
        assert settings.replication_peer_name == f"orders-{other}"
        names = certs.peer_names(cluster, other)
        assert settings.replication_peer_name in names
        assert settings.replication_peer.host in names
        assert f"orders-{broker}" not in names
