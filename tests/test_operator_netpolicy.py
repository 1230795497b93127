"""The brokers' NetworkPolicy (operator/netpolicy.py): what it opens, to whom, and that the
API server takes it as built."""

from __future__ import annotations

from typing import Any

from twinmq.broker.names import ADMIN_PORT, AMQP_PORT, AMQPS_PORT, MIRROR_PORT, REPLICATION_PORT
from twinmq.operator.builders import ClusterRef
from twinmq.operator.kube import Kube
from twinmq.operator.models import BrokerClusterSpec
from twinmq.operator.netpolicy import (
    OPERATOR_NAMESPACE_ENV,
    OPERATOR_SELECTOR_ENV,
    OperatorPods,
    build_network_policy,
)

CLUSTER = ClusterRef(namespace="default", name="orders", uid="uid-1")
OPERATOR = OperatorPods("twinmq-system", {"app.kubernetes.io/component": "operator"})


def rules(spec: BrokerClusterSpec) -> dict[int, list[Any] | None]:
    """Per port: who may connect (None: anyone)."""
    policy = build_network_policy(CLUSTER, spec, OPERATOR)
    out: dict[int, list[Any] | None] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            out[port["port"]] = rule.get("from")
    return out


def test_clients_reach_amqp_the_brokers_each_other_and_the_operator_the_admin_port() -> None:
    policy = build_network_policy(CLUSTER, BrokerClusterSpec(), OPERATOR)
    brokers = policy["spec"]["podSelector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = rules(BrokerClusterSpec())
    assert set(by_port) == {AMQP_PORT, AMQPS_PORT, REPLICATION_PORT, ADMIN_PORT}
    assert by_port[AMQP_PORT] is None and by_port[AMQPS_PORT] is None
    assert by_port[REPLICATION_PORT] == [{"podSelector": brokers}]
    assert by_port[ADMIN_PORT] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "twinmq-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
        }
    ]


def test_a_mirrored_site_opens_its_mirror_port_and_named_namespaces_reach_admin() -> None:
    spec = BrokerClusterSpec.model_validate({
        "mirror": {"role": "replica", "secretName": "dr"},
        "networkPolicy": {"adminNamespaces": ["monitoring"]},
    })  # fmt: skip
    by_port = rules(spec)
    assert by_port[MIRROR_PORT] is None
    admin = by_port[ADMIN_PORT]
    assert admin is not None and admin[1] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }


def test_an_operator_that_does_not_know_its_pods_makes_no_policy() -> None:
    assert OperatorPods.from_env({}) is None
    assert OperatorPods.from_env({OPERATOR_NAMESPACE_ENV: "ops"}) is None
    found = OperatorPods.from_env(
        {OPERATOR_NAMESPACE_ENV: "ops", OPERATOR_SELECTOR_ENV: "a=1, b=2,"}
    )
    assert found == OperatorPods("ops", {"a": "1", "b": "2"})


def test_the_api_server_takes_the_policy_as_built(kube: Kube) -> None:
    built = build_network_policy(CLUSTER, BrokerClusterSpec(), OPERATOR)
    built["metadata"].pop("ownerReferences")  # no BrokerCluster exists on this server
    applied = kube.apply(built)
    assert applied["spec"]["ingress"] == built["spec"]["ingress"]
    assert applied["spec"]["podSelector"] == built["spec"]["podSelector"]
