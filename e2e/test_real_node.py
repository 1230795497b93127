"""The project's real image under a real kubelet and containerd (TWINMQ_NODE=kubelet).

Skipped unless the local cluster's node is a kubelet (the `real_node` fixture). Run:
`flock /tmp/twinmq-cluster.lock make e2e TWINMQ_NODE=kubelet E2E_ARGS="-q e2e/test_real_node.py"`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from chart_release import (
    OperatorRelease,
    create_ready_cluster,
    operator_reconciles,
    operator_release,
)
from failover_scenarios import kill_9_of_the_active_fails_over_losing_nothing
from support import Cluster, client_pod, container_status, finished_phase, pod_path

from twinmq.localcluster import containerd
from twinmq.localcluster.kubelet import project_image
from twinmq.localcluster.layout import Layout, repo_root
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e


def test_a_pod_of_the_project_image_runs_in_containerd_and_its_log_and_exit_code_are_the_kubelets(
    real_node: Cluster, namespace: str
) -> None:
    name = f"hello-{uuid.uuid4().hex[:6]}"
    script = "import sys, twinmq.broker; print('hello from', sys.executable); sys.exit(3)"
    real_node.kube.create(pod_path(namespace), client_pod(name, script))
    phase = wait_for(
        "the pod finished", lambda: finished_phase(real_node.kube, namespace, name), 120
    )
    assert phase == "Failed"
    pod = real_node.kube.get(pod_path(namespace, name))
    state = container_status(pod)
    assert state["containerID"].startswith("containerd://")
    assert state["state"]["terminated"]["exitCode"] == 3
    # The image the kubelet ran is the one `make image` built, by digest.
    archive, references = project_image(repo_root())
    held = containerd.image_digests(Layout.default())
    assert held[references[-1]] == containerd.archive_digest(archive)
    log = real_node.kube.text(f"{pod_path(namespace, name)}/log")
    assert log == "hello from /opt/twinmq/bin/python\n"


def broker_status(cluster: Cluster, namespace: str, pod: str) -> dict[str, Any]:
    """The status of a broker pod's `broker` container."""
    found = cluster.kube.get(pod_path(namespace, pod)) or {}
    statuses = (found.get("status") or {}).get("containerStatuses") or []
    return next(s for s in statuses if s["name"] == "broker")


@pytest.fixture
def release(real_node: Cluster) -> Iterator[OperatorRelease]:
    """The chart's operator (the real image) in a fresh namespace."""
    with operator_release(real_node, "realnode") as release:
        yield release


def test_the_chart_on_a_real_node_fails_over_a_kill_9_in_the_container_losing_nothing(
    release: OperatorRelease,
) -> None:
    cluster, namespace = release.cluster, release.namespace
    create_ready_cluster(release, "orders")
    restarts_before = broker_status(cluster, namespace, "orders-primary")["restartCount"]
    kill_9_of_the_active_fails_over_losing_nothing(cluster, namespace, "orders")

    def restarted_after_sigkill() -> bool:
        state = broker_status(cluster, namespace, "orders-primary")
        last = (state.get("lastState") or {}).get("terminated") or {}
        return state["restartCount"] > restarts_before and last.get("exitCode") == 137

    # The kubelet saw the container die of SIGKILL and restarted it (restartPolicy Always).
    wait_for("the killed broker container restarted by the kubelet", restarted_after_sigkill)
    operator_reconciles(release)  # reads the operator's log through the kubelet
