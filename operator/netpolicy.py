"""The NetworkPolicy of a BrokerCluster's broker pods (issue 16; opt-out).

Ingress to the brokers, by port, and nothing else:

- AMQP (5672) and, with `spec.tls`, AMQPS (5671): from anywhere (the applications,
  other sites' federation links), as RabbitMQ's operator allows its client ports;
- the mirror port, on a mirrored site: from anywhere (the other site; the link has its
  own token), except on a full-mesh site whose targets are all BrokerClusters' Services in
  this Kubernetes cluster: in a mesh every site dials every other, so the sites it lists
  are exactly the ones that dial it, and only their broker pods are let in;
- replication (5673): from this cluster's two broker pods only;
- admin (15672: role changes, status, metrics): from the operator's pods, and from the
  pods of the namespaces `spec.networkPolicy.adminNamespaces` names (Prometheus scraping
  `/metrics` with the metrics token).

The operator names its own pods by the namespace and labels the chart gives it
(`OPERATOR_NAMESPACE_ENV`, `OPERATOR_SELECTOR_ENV`). An operator that does not know them
(run outside the cluster, as in development) creates no policy and says why: a policy
that shut the operator out of the admin port would stop failover. The kubelet's probes
come from the node, which NetworkPolicy implementations let through.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from twinmq.broker.names import ADMIN_PORT, AMQP_PORT, AMQPS_PORT, ENV_PREFIX, REPLICATION_PORT
from twinmq.operator import mirroring, peerca
from twinmq.operator.builders import ClusterRef, broker_selector, owned_meta
from twinmq.operator.models import BrokerClusterSpec

Obj = dict[str, Any]

OPERATOR_NAMESPACE_ENV = ENV_PREFIX + "OPERATOR_POD_NAMESPACE"
"""The operator pod's namespace (the chart sets it from the downward API)."""
OPERATOR_SELECTOR_ENV = ENV_PREFIX + "OPERATOR_POD_SELECTOR"
"""The operator pods' labels, `key=value,...` (the chart sets its selector labels)."""
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


@dataclass(frozen=True)
class OperatorPods:
    """Where the operator's pods are, for the admin port's rule."""

    namespace: str
    labels: dict[str, str]

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorPods | None:
        """From the chart's variables; None when the operator does not know its pods."""
        namespace = env.get(OPERATOR_NAMESPACE_ENV, "")
        pairs = [item.split("=", 1) for item in env.get(OPERATOR_SELECTOR_ENV, "").split(",")]
        labels = {key.strip(): value.strip() for key, value in (p for p in pairs if len(p) == 2)}
        if not namespace or not labels:
            return None
        return cls(namespace, labels)

    def peer(self) -> Obj:
        """The NetworkPolicyPeer of the operator's pods."""
        return {
            "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: self.namespace}},
            "podSelector": {"matchLabels": dict(self.labels)},
        }


def mesh_peers(spec: BrokerClusterSpec) -> list[Obj] | None:
    """The NetworkPolicyPeers of a full mesh's other sites (their broker pods), when every
    target is a BrokerCluster's Service here; None: the mirror port stays open to all (one
    way or a ring, whose incoming site is not the target; a target in another cluster)."""
    mirror = spec.mirror
    if mirror is None or not mirror.targets:
        return None
    sites = [peerca.service_of(target.host) for target in mirror.targets]
    if any(site is None for site in sites):
        return None
    return [
        {
            "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}},
            "podSelector": broker_selector(ClusterRef(name=name, namespace=namespace, uid="")),
        }
        for namespace, name in (site for site in sites if site is not None)
    ]


def policy_name(cluster: ClusterRef) -> str:
    """The policy's name: `<cluster>-brokers`."""
    return f"{cluster.name}-brokers"


def build_network_policy(
    cluster: ClusterRef, spec: BrokerClusterSpec, operator: OperatorPods
) -> Obj:
    """The broker pods' NetworkPolicy (see the module)."""
    brokers = broker_selector(cluster)
    admin_from = [operator.peer()] + [
        {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: namespace}}}
        for namespace in spec.network_policy.admin_namespaces
    ]
    amqps = [{"protocol": "TCP", "port": AMQPS_PORT}] if spec.tls.enabled else []
    mirror_ports = [
        {"protocol": "TCP", "port": port["containerPort"]}
        for port in mirroring.container_ports(spec.mirror)
    ]
    peers = mesh_peers(spec)
    open_ports = [{"protocol": "TCP", "port": AMQP_PORT}, *amqps]
    if peers is None:
        open_ports += mirror_ports
    mesh = [{"from": peers, "ports": mirror_ports}] if peers is not None else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owned_meta(cluster, policy_name(cluster)),
        "spec": {
            "podSelector": brokers,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": open_ports},
                {
                    "from": [{"podSelector": brokers}],
                    "ports": [{"protocol": "TCP", "port": REPLICATION_PORT}],
                },
                {"from": admin_from, "ports": [{"protocol": "TCP", "port": ADMIN_PORT}]},
                *mesh,
            ],
        },
    }
