"""The local cluster's fault tools do what tests need: kill, pause, cut, node and API outages.

Only on the local cluster (the tools act on the host: processes, cgroups, veths), with
either node kind: the real kubelet + containerd or the node agent.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import urllib3
from support import IMAGE, Cluster, Obj, container_status, is_ready, pod_path, read_pod

from twinmq.localcluster import faults
from twinmq.localcluster.layout import Layout
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e


def _server_pod(name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "web",
                    "image": IMAGE,
                    "command": ["python", "-m", "http.server", "8080"],
                    "readinessProbe": {
                        "httpGet": {"port": 8080, "path": "/"},
                        "periodSeconds": 1,
                        "failureThreshold": 1,
                        "timeoutSeconds": 1,
                    },
                }
            ],
        },
    }


@pytest.fixture
def layout(cluster: Cluster) -> Layout:
    """The local cluster's layout (skips the test on any other cluster)."""
    if not cluster.local:
        pytest.skip("fault tools act on the local cluster's host")
    return Layout.default()


@pytest.fixture
def web(cluster: Cluster, layout: Layout, namespace: str) -> Iterator[tuple[str, str]]:
    """A ready pod with an HTTP readiness probe: (namespace, name)."""
    cluster.kube.create(pod_path(namespace), _server_pod("web"))
    wait_for("web ready", lambda: is_ready(read_pod(cluster.kube, namespace, "web")), 60)
    yield namespace, "web"


def _ready(cluster: Cluster, namespace: str, name: str) -> bool:
    return is_ready(read_pod(cluster.kube, namespace, name))


def test_cut_network_makes_the_pod_unready_until_healed(
    cluster: Cluster, layout: Layout, web: tuple[str, str]
) -> None:
    namespace, name = web
    faults.cut_network(layout, namespace, name)
    try:
        wait_for("unready while cut", lambda: not _ready(cluster, namespace, name), 30)
    finally:
        faults.heal_network(layout, namespace, name)
    wait_for("ready after heal", lambda: _ready(cluster, namespace, name), 30)


def test_paused_pod_is_unready_until_resumed(
    cluster: Cluster, layout: Layout, web: tuple[str, str]
) -> None:
    namespace, name = web
    assert faults.pause_pod(layout, namespace, name)
    try:
        wait_for("unready while paused", lambda: not _ready(cluster, namespace, name), 30)
    finally:
        faults.resume_pod(layout, namespace, name)
    wait_for("ready after resume", lambda: _ready(cluster, namespace, name), 30)


def test_pods_keep_running_across_a_node_restart(
    cluster: Cluster, layout: Layout, web: tuple[str, str]
) -> None:
    """The node's daemon (the kubelet, or the node agent) stopped and started again: the pod
    is not restarted, and the new daemon manages it (restarts it after a kill)."""
    namespace, name = web
    node = faults.node_component(layout)
    pid = faults.container_pid(layout, namespace, name, "web")
    assert pid is not None
    faults.stop_component(layout, node)
    try:
        assert faults.container_pid(layout, namespace, name, "web") == pid  # no node, still up
    finally:
        faults.start_component(layout, node)
    # Adopted, not restarted: same process, no restart counted, still ready; and managed again.
    wait_for(f"ready after {node} restart", lambda: _ready(cluster, namespace, name), 30)
    assert faults.container_pid(layout, namespace, name, "web") == pid
    assert container_status(read_pod(cluster.kube, namespace, name))["restartCount"] == 0
    faults.kill_pod(layout, namespace, name)
    wait_for(
        f"restart by the new {node}",
        lambda: container_status(read_pod(cluster.kube, namespace, name)).get("restartCount"),
        60,
    )


def test_pods_keep_running_while_the_api_server_is_down(
    cluster: Cluster, layout: Layout, web: tuple[str, str]
) -> None:
    namespace, name = web
    pid = faults.container_pid(layout, namespace, name, "web")
    assert pid is not None
    with faults.api_server_down(layout):
        with pytest.raises(urllib3.exceptions.HTTPError):
            cluster.kube.request("GET", "/version", timeout=2)
        assert faults.container_pid(layout, namespace, name, "web") == pid
    wait_for("API back and pod ready", lambda: _ready(cluster, namespace, name), 60)
    node = cluster.kube.get("/api/v1/nodes/twinmq-node")
    assert node is not None
