"""A real kube-apiserver (and its etcd) on loopback, for tests of the operator's API I/O.

The binaries are the local cluster's (`make cluster-binaries`, shared in
~/.cache/twinmq/k8s); everything else (certificates, etcd's data, logs) lives in the
test's own directory and on free loopback ports, so it never meets the machine-global
local cluster. No controller manager, scheduler or node: objects such as Leases and
ConfigMaps are stored and served, nothing reconciles them.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kubernetes.dynamic.exceptions import ResourceNotFoundError

from twinmq.localcluster import binaries
from twinmq.localcluster.cluster import ControlPlane, _argv, _http_ok
from twinmq.localcluster.layout import Layout
from twinmq.localcluster.pki import ADMIN_USER, admin_token, ensure_pki
from twinmq.localcluster.pki import kubeconfig as pki_kubeconfig
from twinmq.operator.crd import crd
from twinmq.operator.kube import Kube
from twinmq.operator.models import GROUP, KIND, VERSION
from twinmq.testing.launcher import free_port
from twinmq.testing.waiting import wait_for

STARTUP_SECONDS = 120.0  # a loaded, shared machine: etcd and the API server are slow to start


def binaries_built() -> bool:
    """Whether etcd and kube-apiserver are in the shared cache."""
    try:
        binaries.find("etcd")
        binaries.find("kube-apiserver")
    except FileNotFoundError:
        return False
    return True


def _wait_ready(url: str, token: str, ca: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    def ready() -> bool:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"the test API server exited before it was ready at {url}")
        return _http_ok(url, token, ca)

    wait_for(f"the test API server ready at {url}", ready, STARTUP_SECONDS, interval=0.2)


@dataclass(frozen=True)
class KubeApiServer:
    """A running test API server: an admin kubeconfig, and its process (to pause it)."""

    kubeconfig: Path
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def running_apiserver(root: Path) -> Iterator[KubeApiServer]:
    """etcd + kube-apiserver on 127.0.0.1 under `root`."""
    layout = Layout(root)
    ensure_pki(layout)
    pki = layout.pki
    layout.logs.mkdir(parents=True, exist_ok=True)
    # The local cluster's argv on loopback with free ports; RBAC only (no node authorizer:
    # no kubelet here) and a service range of its own.
    plane = ControlPlane(
        address="127.0.0.1",
        apiserver_port=free_port(),
        etcd_client_port=free_port(),
        etcd_peer_port=free_port(),
        authorization="RBAC",
        service_cidr="10.97.0.0/16",
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("etcd", "kube-apiserver"):
            argv = _argv(layout, name, plane)
            with (layout.logs / f"{name}.log").open("wb") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        url = f"https://{plane.address}:{plane.apiserver_port}"
        token = admin_token(layout)
        _wait_ready(f"{url}/readyz", token, pki / "ca.crt", procs)
        kubeconfig = root / "kubeconfig"
        kubeconfig.write_text(json.dumps(pki_kubeconfig(layout, url, ADMIN_USER, {"token": token})))
        yield KubeApiServer(kubeconfig, procs[1])
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def install_crd(api: Kube) -> None:
    """Apply the BrokerCluster CRD and wait until the API server serves the kind."""
    api.apply(crd())

    def established() -> bool:
        try:
            api.dynamic.resources.invalidate_cache()
            api.dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=KIND)
        except ResourceNotFoundError:
            return False
        return True

    wait_for("the CRD established", established, 60)
