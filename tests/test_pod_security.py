"""Broker pods meet the `restricted` Pod Security Standard: the real API server's
PodSecurity admission, enforcing `restricted` on a namespace, accepts them (dry run)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from twinmq.operator.builders import ClusterRef, build_pod
from twinmq.operator.kube import Kube
from twinmq.operator.models import BrokerClusterSpec

NAMESPACES = (f"restricted-{n}" for n in itertools.count())


def restricted_namespace(kube: Kube) -> str:
    """A namespace where PodSecurity admission enforces the `restricted` level."""
    name = next(NAMESPACES)
    labels = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}  # fmt: skip
    kube.core.create_namespace({"metadata": {"name": name, "labels": labels}})
    return name


def dry_run_create(kube: Kube, pod: dict[str, Any]) -> None:
    namespace = pod["metadata"]["namespace"]
    kube.core.create_namespaced_pod(namespace, pod, dry_run="All")


@pytest.mark.parametrize("audited", [False, True])
def test_broker_pods_are_admitted_where_restricted_is_enforced(kube: Kube, audited: bool) -> None:
    namespace = restricted_namespace(kube)
    spec = BrokerClusterSpec.model_validate(
        {"audit": {"enabled": True, "storeUrl": "s3://audit/orders"}} if audited else {}
    )
    cluster = ClusterRef(namespace=namespace, name="orders", uid="u-1")
    pod = build_pod(cluster, spec, "primary")
    assert len(pod["spec"]["containers"]) == (2 if audited else 1)  # the shipper too
    kube.core.create_namespaced_service_account(
        namespace, {"metadata": {"name": pod["spec"]["serviceAccountName"]}}
    )
    dry_run_create(kube, pod)


def test_a_pod_without_the_hardening_is_refused_there(kube: Kube) -> None:
    """The check can fail: the same pod stripped of its securityContexts is refused."""
    namespace = restricted_namespace(kube)
    pod = build_pod(ClusterRef(namespace=namespace, name="orders", uid="u-1"),
                    BrokerClusterSpec(), "primary")  # fmt: skip
    del pod["spec"]["securityContext"]
    for container in pod["spec"]["containers"]:
        del container["securityContext"]
    kube.core.create_namespaced_service_account(
        namespace, {"metadata": {"name": pod["spec"]["serviceAccountName"]}}
    )
    with pytest.raises(ApiException) as refused:
        dry_run_create(kube, pod)
    assert refused.value.status == 403 and "restricted" in str(refused.value.body)
