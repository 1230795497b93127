"""The BrokerCluster CRD on a real API server: defaults applied, invalid specs refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from brokerclusters import install_crd
from support import Cluster

from twinmq.localcluster.kubeapi import ApiError
from twinmq.operator.models import BrokerClusterSpec

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@pytest.fixture(scope="module")
def crd_installed(cluster: Cluster) -> Iterator[None]:
    """The CRD applied server-side, and established."""
    install_crd(cluster)
    yield


def _create(cluster: Cluster, namespace: str, spec: dict[str, Any], name: str) -> Any:
    return cluster.kube.create(
        f"/apis/twinmq.io/v1alpha1/namespaces/{namespace}/brokerclusters",
        {"apiVersion": "twinmq.io/v1alpha1", "kind": "BrokerCluster",
         "metadata": {"name": name}, "spec": spec},
    )  # fmt: skip


def test_example_is_accepted_and_defaults_match_the_model(
    cluster: Cluster, crd_installed: None, namespace: str
) -> None:
    example = yaml.safe_load((REPO / "examples" / "brokercluster.yaml").read_text())
    created = _create(cluster, namespace, example["spec"], "orders")
    spec = BrokerClusterSpec.model_validate(created["spec"])
    assert spec == BrokerClusterSpec.model_validate(example["spec"])
    empty = _create(cluster, namespace, {}, "defaults")
    assert BrokerClusterSpec.model_validate(empty["spec"]) == BrokerClusterSpec()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"failover": {"probeIntervalSeconds": 10, "leaseDurationSeconds": 5}},
            "leaseDurationSeconds must be longer than probeIntervalSeconds",
        ),
        ({"storage": {"size": "lots"}}, "spec.storage.size"),
        ({"requests": {"promote": {"id": "a", "broker": "tertiary"}}}, "supported values"),
        ({"audit": {"schedule": "every day"}}, "five-field cron"),
        ({"audit": {"enabled": True}}, "audits need a storeUrl"),
        ({"audit": {"storeUrl": "/var/lib/twinmq-audit"}}, "storeUrl must start with s3://"),
        ({"audit": {"resources": {"driverMemory": "lots"}}}, "spec.audit.resources.driverMemory"),
        ({"failover": {"failureThreshold": 0}}, "spec.failover.failureThreshold"),
        (
            {"podTemplate": {"metadata": {"labels": {"twinmq.io/role": "active"}}}},
            "podTemplate.metadata.labels cannot use the operator's own prefixes",
        ),
        (
            {"podTemplate": {"metadata": {"annotations": {"app.kubernetes.io/name": "x"}}}},
            "podTemplate.metadata.annotations cannot use the operator's own prefixes",
        ),
        ({"placement": {"antiAffinity": "sometimes"}}, "spec.placement.antiAffinity"),
        ({"podTemplate": {"tolerations": [{"effect": "NoRun"}]}}, "tolerations[0].effect"),
        (
            {"mirror": {"role": "source", "secretName": "dr"}},
            "a mirror source or bidirectional site names its target",
        ),
        (
            {"mirror": {"role": "bidirectional", "secretName": "dr"}},
            "a mirror source or bidirectional site names its target",
        ),
        (
            {"requests": {"mirrorPromote": {"id": "p", "token": "{}", "force": True}}},
            "give the source's demotion token, or force",
        ),
        ({"requests": {"mirrorPromote": {"id": "p"}}}, "give the source's demotion token"),
        ({"mirror": {"role": "replica"}}, "spec.mirror.secretName"),
        ({"mirror": {"role": "both", "secretName": "dr"}}, "spec.mirror.role"),
    ],
)
def test_invalid_specs_are_refused_with_a_clear_message(
    cluster: Cluster, crd_installed: None, namespace: str, spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ApiError) as err:
        _create(cluster, namespace, spec, "bad")
    assert err.value.status == 422
    assert message in str(err.value)
