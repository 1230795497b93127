"""e2e fixtures: a Kubernetes API (whatever KUBECONFIG names, else the local cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from brokerclusters import OperatorProcess, operator_fixture
from support import Cluster, new_namespace

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Use $KUBECONFIG if set; otherwise start the local cluster (and stop it if we started it)."""
    explicit = os.environ.get("KUBECONFIG")
    if explicit:
        local = "TWINMQ_E2E_LOCAL" in os.environ or explicit.endswith(".cluster/kubeconfig")
        yield Cluster(explicit, local)
        return
    from twinmq.localcluster import daemons
    from twinmq.localcluster.cluster import components
    from twinmq.localcluster.layout import Layout, node_mode

    layout = Layout.default()
    running = all(daemons.read_pid(layout, c) is not None for c in components(node_mode()))
    cmd = [sys.executable, "-m", "twinmq.localcluster.cluster"]
    if not running:
        subprocess.run([*cmd, "up"], check=True)
    try:
        yield Cluster(str(layout.kubeconfig), local=True)
    finally:
        if not running and not os.environ.get("TWINMQ_E2E_KEEP_CLUSTER"):
            subprocess.run([*cmd, "down"], check=False)


def kubelet_node(cluster: Cluster) -> bool:
    """Whether the cluster under test is the local one with a real kubelet node."""
    if not cluster.local:
        return False
    from twinmq.localcluster.cluster import running_mode
    from twinmq.localcluster.layout import Layout

    return running_mode(Layout.default()) == "kubelet"


@pytest.fixture
def real_node(cluster: Cluster) -> Cluster:
    """The local cluster, when its node is a real kubelet (TWINMQ_NODE=kubelet); else skip."""
    if not kubelet_node(cluster):
        pytest.skip("needs the local cluster with a real kubelet node (TWINMQ_NODE=kubelet)")
    return cluster


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    name = new_namespace(cluster)
    yield name
    cluster.kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    """The BrokerCluster CRD installed and `twinmq-operator` running for this module."""
    yield from operator_fixture(cluster)
