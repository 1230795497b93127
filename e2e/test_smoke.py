"""Smoke scenarios against a real Kubernetes API: the chart, a broker pod, Services, DNS,
restarts and garbage collection. Runs on the local cluster (both node modes); written
for kind too (`e2e/run-on-kind.sh`), not run there."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from support import (
    AMQP_PROBE,
    CHART,
    IMAGE,
    Cluster,
    Obj,
    client_pod,
    container_status,
    finished_phase,
    helm,
    is_ready,
    phase,
    pod_path,
    read_pod,
    ready_pod,
)

from twinmq.localcluster.kubeapi import ApiError
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e


@dataclass
class Release:
    """One installed chart release with a standalone broker."""

    name: str
    namespace: str
    fullname: str

    @property
    def broker_pod(self) -> str:
        """The StatefulSet's only pod."""
        return f"{self.fullname}-broker-0"


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[Release]:
    """Install the chart in a fresh namespace; uninstall and delete the namespace after."""
    namespace = f"e2e-chart-{uuid.uuid4().hex[:6]}"
    name = "smoke"
    repository, _, tag = IMAGE.rpartition(":")
    helm(
        cluster.kubeconfig, "install", name, str(CHART), "--namespace", namespace,
        "--create-namespace", "--set", f"image.repository={repository}",
        "--set", f"image.tag={tag}", "--set", "broker.enabled=true",
        "--set", "operator.enabled=false", "--wait", "--timeout", "120s",
    )  # fmt: skip
    try:
        yield Release(name, namespace, f"{name}-twinmq")
    finally:
        helm(cluster.kubeconfig, "uninstall", name, "--namespace", namespace, "--wait")
        cluster.kube.delete(f"/api/v1/namespaces/{namespace}")


def _ready_broker(cluster: Cluster, release: Release) -> Obj:
    return wait_for(
        "broker pod Ready",
        lambda: ready_pod(cluster.kube, release.namespace, release.broker_pod),
        timeout=90,
    )


def test_chart_install_makes_a_ready_broker_pod(cluster: Cluster, release: Release) -> None:
    pod = _ready_broker(cluster, release)
    assert pod["status"]["podIP"]
    assert "running" in container_status(pod)["state"]


def test_client_pod_reaches_broker_by_cluster_ip_and_pod_dns_name(
    cluster: Cluster, release: Release
) -> None:
    service = cluster.kube.get(
        f"/api/v1/namespaces/{release.namespace}/services/{release.fullname}"
    )
    assert service is not None
    cluster_ip = service["spec"]["clusterIP"]
    headless = f"{release.fullname}-headless"
    dns_name = f"{release.broker_pod}.{headless}.{release.namespace}.svc.cluster.local"
    _ready_broker(cluster, release)
    name = f"client-{uuid.uuid4().hex[:6]}"
    pod = client_pod(name, AMQP_PROBE, f"{cluster_ip}:5672", f"{dns_name}:5672")
    cluster.kube.create(pod_path(release.namespace), pod)
    final = wait_for(
        "client pod to finish",
        lambda: finished_phase(cluster.kube, release.namespace, name),
        timeout=60,
    )
    assert final == "Succeeded", _describe(cluster, release.namespace, name)
    logs = cluster.kube.text(f"{pod_path(release.namespace, name)}/log")  # via the node's API
    assert logs.count("reached") == 2, logs


def test_killed_broker_process_is_restarted_and_ready_again(
    cluster: Cluster, release: Release
) -> None:
    before = _ready_broker(cluster, release)
    restarts = container_status(before)["restartCount"]
    _kill_broker(cluster, release)

    def restarted_and_ready() -> Obj | None:
        pod = read_pod(cluster.kube, release.namespace, release.broker_pod)
        if container_status(pod).get("restartCount", 0) > restarts and is_ready(pod):
            return pod
        return None

    after = wait_for("a restarted, ready broker", restarted_and_ready, timeout=90)
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # same pod, new process
    last = container_status(after)["lastState"]["terminated"]
    assert last["exitCode"] == 137


def test_deleting_an_owner_garbage_collects_its_dependents(
    cluster: Cluster, namespace: str
) -> None:
    owner = cluster.kube.create(
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"metadata": {"name": "owner"}, "data": {"role": "owner"}},
    )
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
    }
    pod = client_pod("dependent", "import time; time.sleep(3600)")
    pod["metadata"]["ownerReferences"] = [reference]
    pod["spec"]["terminationGracePeriodSeconds"] = 5
    cluster.kube.create(pod_path(namespace), pod)
    secret = {"metadata": {"name": "dependent", "ownerReferences": [reference]}}
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", secret)
    wait_for(
        "dependent pod running",
        lambda: phase(read_pod(cluster.kube, namespace, "dependent")) == "Running",
        timeout=60,
    )
    cluster.kube.delete(f"/api/v1/namespaces/{namespace}/configmaps/owner")
    wait_for(
        "dependent pod and secret gone",
        lambda: (
            read_pod(cluster.kube, namespace, "dependent") is None
            and cluster.kube.get(f"/api/v1/namespaces/{namespace}/secrets/dependent") is None
        ),
        timeout=60,
    )


def test_pod_with_an_unavailable_image_reports_an_image_pull_error(
    cluster: Cluster, namespace: str
) -> None:
    if not cluster.local:
        pytest.skip("which images exist is specific to the process-backed node")
    pod = client_pod("bad-image", "print('never')")
    pod["spec"]["containers"][0]["image"] = "registry.invalid/nothing:1"
    cluster.kube.create(pod_path(namespace), pod)

    def pull_error() -> str | None:
        waiting = (
            container_status(read_pod(cluster.kube, namespace, "bad-image"))
            .get("state", {})
            .get("waiting")
            or {}
        )
        reason = waiting.get("reason")
        return reason if reason in ("ErrImagePull", "ImagePullBackOff") else None

    assert wait_for("an image pull error", pull_error, timeout=30)


def _kill_broker(cluster: Cluster, release: Release) -> None:
    if cluster.local:
        from twinmq.localcluster.faults import kill_pod
        from twinmq.localcluster.layout import Layout

        assert kill_pod(Layout.default(), release.namespace, release.broker_pod)
        return
    node = os.environ.get("TWINMQ_E2E_KIND_NODE", "twinmq-e2e-control-plane")
    subprocess.run(["docker", "exec", node, "pkill", "-9", "-f", "twinmq-broker"], check=True)


def _describe(cluster: Cluster, namespace: str, name: str) -> str:
    pod = read_pod(cluster.kube, namespace, name)
    try:
        logs = cluster.kube.text(f"{pod_path(namespace, name)}/log")
    except ApiError as error:
        logs = f"(no logs: {error})"
    return f"{(pod or {}).get('status')}\n{logs}"
