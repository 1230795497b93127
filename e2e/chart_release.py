"""The chart with its operator, installed for an e2e module, and a BrokerCluster under it.

The operator runs as the chart's Deployment with namespace-scoped RBAC (a Role): it
watches only its release namespace, so it never touches another test's clusters. (A
cluster-wide operator running at the same time, such as e2e/test_operator.py's, also sees
this namespace; `operator_reconciles` checks this chart's operator itself did the work.)
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from brokerclusters import cluster_path, cluster_status, in_sync, wait_answering
from support import CHART, IMAGE, Cluster, helm, is_ready

from twinmq.localcluster.examples import example_brokercluster
from twinmq.testing.waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
Obj = dict[str, Any]


@dataclass
class OperatorRelease:
    """An installed release: where, its operator pod, and what the install took."""

    cluster: Cluster
    name: str
    namespace: str
    install_seconds: float = 0.0
    installed: bool = True
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def deployment(self) -> str:
        """The operator Deployment's name."""
        return f"{self.name}-twinmq-operator"

    def operator_pods(self) -> list[Obj]:
        """The operator's pods (by the chart's selector labels)."""
        selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=operator"
        return self.cluster.kube.list(
            f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector
        )

    def ready_operator_pod(self) -> Obj | None:
        """The operator pod once it is Ready (for `wait_for`)."""
        pods = [p for p in self.operator_pods() if not p["metadata"].get("deletionTimestamp")]
        return pods[0] if len(pods) == 1 and is_ready(pods[0]) else None

    def operator_log(self) -> str:
        """The operator container's log."""
        pod = self.ready_operator_pod()
        assert pod is not None, "no ready operator pod"
        name = pod["metadata"]["name"]
        return self.cluster.kube.text(f"/api/v1/namespaces/{self.namespace}/pods/{name}/log")

    def uninstall(self) -> None:
        """`helm uninstall --wait` (once)."""
        if self.installed:
            helm(self.cluster.kubeconfig, "uninstall", self.name, "--namespace", self.namespace,
                 "--wait", "--timeout", "120s")  # fmt: skip
            self.installed = False


@contextmanager
def operator_release(cluster: Cluster, prefix: str, *sets: str) -> Iterator[OperatorRelease]:
    """Install the chart (operator only, namespace scope, and the `--set` values given) into
    a fresh namespace; afterwards uninstall it and delete the namespace."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    repository, _, tag = IMAGE.rpartition(":")
    started = time.monotonic()
    helm(
        cluster.kubeconfig, "install", "tmq", str(CHART), "--namespace", namespace,
        "--create-namespace", "--set", "operator.rbac.scope=namespace",
        "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        *(arg for value in sets for arg in ("--set", value)), "--wait", "--timeout", "120s",
    )  # fmt: skip
    release = OperatorRelease(cluster, "tmq", namespace, time.monotonic() - started)
    try:
        yield release
    finally:
        remove_brokerclusters(cluster, namespace)
        release.uninstall()
        cluster.kube.delete(f"/api/v1/namespaces/{namespace}")


def remove_brokerclusters(cluster: Cluster, namespace: str) -> None:
    """Delete the namespace's BrokerClusters while the operator still runs: kopf put a
    finalizer on each, which only a running operator removes. Should they outlive it, the
    finalizer is dropped so that the namespace can go."""
    clusters = cluster_path(namespace)
    for item in cluster.kube.list(clusters):
        cluster.kube.delete(f"{clusters}/{item['metadata']['name']}")
    try:
        wait_for("the BrokerClusters gone", lambda: not cluster.kube.list(clusters), 60)
    except TimeoutError:
        for item in cluster.kube.list(clusters):
            path = f"{clusters}/{item['metadata']['name']}"
            cluster.kube.patch(path, {"metadata": {"finalizers": None}})


def brokercluster(name: str = "orders") -> Obj:
    """The example BrokerCluster (examples/brokercluster.yaml) with the test image."""
    example: Obj = example_brokercluster()
    example["metadata"]["name"] = name
    example["spec"]["image"] = IMAGE
    return example


def create_ready_cluster(release: OperatorRelease, name: str = "orders", **spec: Any) -> Obj:
    """Apply a BrokerCluster (the example, with the top-level `spec` fields given replaced)
    and wait until it is Ready with the primary active and the backup in sync; returns the
    status. Records the time in `release.timings`."""
    cluster = release.cluster
    started = time.monotonic()
    body = brokercluster(name)
    body["spec"].update(spec)
    cluster.kube.create(cluster_path(release.namespace), body)

    def ready() -> Obj | None:
        state = cluster_status(cluster, release.namespace, name)
        return state if in_sync(state) else None

    state = wait_for(f"BrokerCluster {name} Ready and replicating", ready, timeout=120)
    wait_answering(cluster, release.namespace, name)
    release.timings[f"{name} Ready"] = time.monotonic() - started
    return state


def operator_reconciles(release: OperatorRelease) -> str:
    """This release's operator reconciled its namespace's cluster with its own RBAC: its
    timer ran and succeeded (kopf logs it; it watches nothing else) or it logged about the
    cluster, and nothing was refused once it had begun. A request refused before its first
    success is the authorizer not yet serving the Role the chart has just made (RBAC
    reaches the API server's cache a moment after the object, kopf retries): a verb the
    Role lacks is refused again at every pass, after the first success too."""
    log = release.operator_log()
    assert "Timer 'tick' succeeded" in log or f"{release.namespace}/" in log, log[-3000:]
    begun = min((at for at in (log.find(" succeeded"), log.find(f"{release.namespace}/"))
                 if at >= 0), default=0)  # fmt: skip
    for bad in ("Forbidden", "forbidden", "Timer 'tick' failed", "Not enough permissions"):
        at = log.find(bad, begun)
        assert at < 0, f"{bad!r} in the operator's log:\n{log[max(0, at - 2500) : at + 1500]}"
    return log


def liveness(pod: Obj) -> int:
    """GET the operator pod's /healthz from this host (the pod network is routed here on
    the local cluster); returns the HTTP status."""
    url = f"http://{pod['status']['podIP']}:8080/healthz"
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status)
