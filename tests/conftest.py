"""Shared fixtures: real broker processes on loopback, on throw-away data directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apiserver import KubeApiServer, binaries_built, install_crd, running_apiserver

from twinmq.operator.kube import Kube
from twinmq.testing.certs import TestCA
from twinmq.testing.launcher import BrokerProcess


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A broker shared by the tests of one module (they use distinct queue names)."""
    data = tmp_path_factory.mktemp("broker") / "data"
    with BrokerProcess(data, name="test-broker") as proc:
        yield proc


@pytest.fixture
def fresh_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A broker of the test's own (for tests that restart, kill or configure it)."""
    with BrokerProcess(tmp_path / "data", name="fresh-broker") as proc:
        yield proc


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for every Spark test (PySpark from the `audit` extra).

    local[1], one shuffle partition and no UI keep it quick on a small machine.
    """
    pytest.importorskip("pyspark")
    from twinmq.audit.job import build_session

    session = build_session(
        "local[1]",
        "twinmq-audit-tests",
        {
            "spark.sql.shuffle.partitions": "1",
            "spark.ui.enabled": "false",
            "spark.default.parallelism": "1",
        },
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def kube_apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApiServer]:
    """A real kube-apiserver and its etcd on loopback, shared by the session's tests (the
    local cluster's binaries; skipped when they are not built)."""
    if not binaries_built():
        pytest.skip("etcd/kube-apiserver not built: make cluster-binaries")
    with running_apiserver(tmp_path_factory.mktemp("apiserver")) as api:
        yield api


@pytest.fixture
def kube(kube_apiserver: KubeApiServer) -> Kube:
    """The operator's API client, pointed at the test API server."""
    return Kube(str(kube_apiserver.kubeconfig))


@pytest.fixture(scope="module")
def api(kube_apiserver: KubeApiServer) -> Kube:
    """The operator's API client with the BrokerCluster CRD installed and served."""
    found = Kube(str(kube_apiserver.kubeconfig))
    install_crd(found)
    return found


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    """A broker's server CA (operator-managed in a cluster), not the applications' CA."""
    return TestCA(tmp_path / "server-pki", name="TwinMQ server CA")


@pytest.fixture
def apps(tmp_path: Path) -> TestCA:
    """The applications' CA (`--tls-ca`, the bundle `spec.tls.clientCertificates` names):
    the client certificates it signs log in or are refused."""
    return TestCA(tmp_path / "apps-pki", name="applications CA")
