"""Helpers for the e2e suite: waiting on conditions, pods, helm.

Everything waits for a condition with a deadline (never a bare sleep).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, TypeVar

import pytest

from twinmq.localcluster.kubeapi import KubeApi
from twinmq.testing.waiting import wait_for

T = TypeVar("T")
Obj = dict[str, Any]

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "twinmq"
IMAGE = os.environ.get("TWINMQ_E2E_IMAGE", "twinmq/twinmq:dev")
AUDIT_IMAGE = os.environ.get("TWINMQ_E2E_AUDIT_IMAGE", "docker.io/twinmq/twinmq-audit:dev")
"""The Spark audit's image (`make image-audit`; the broker image has no JRE or PySpark)."""


class Cluster:
    """The cluster under test: its kubeconfig and whether it is this machine's local cluster."""

    def __init__(self, kubeconfig: str, local: bool) -> None:
        self.kubeconfig = kubeconfig
        self.local = local
        self.kube = KubeApi(kubeconfig)


def new_namespace(cluster: Cluster, prefix: str = "e2e") -> str:
    """A fresh namespace, once its default ServiceAccount exists (pods need it)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.kube.create("/api/v1/namespaces", {"metadata": {"name": name}})
    path = f"/api/v1/namespaces/{name}/serviceaccounts/default"
    wait_for(f"serviceaccount default in {name}", lambda: cluster.kube.get(path), 30)
    return name


def pod_path(namespace: str, name: str = "") -> str:
    """Return the API path of a pod (or of the namespace's pods)."""
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


def read_pod(kube: KubeApi, namespace: str, name: str) -> Obj | None:
    """Return the pod, or None when it does not exist."""
    return kube.get(pod_path(namespace, name))


def is_ready(pod: Obj | None) -> bool:
    """Return whether `pod` has condition Ready=True."""
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def ready_pod(kube: KubeApi, namespace: str, name: str) -> Obj | None:
    """Return the pod if it is Ready, else None (for `wait_for`)."""
    pod = read_pod(kube, namespace, name)
    return pod if is_ready(pod) else None


def container_status(pod: Obj | None, index: int = 0) -> Obj:
    """Return a container's status ({} when not reported yet)."""
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return dict(statuses[index]) if len(statuses) > index else {}


def phase(pod: Obj | None) -> str:
    """Return the pod's phase ('' when unknown)."""
    return str(((pod or {}).get("status") or {}).get("phase") or "")


def finished_phase(kube: KubeApi, namespace: str, name: str) -> str | None:
    """Return the pod's phase once it is Succeeded or Failed, else None (for `wait_for`)."""
    current = phase(read_pod(kube, namespace, name))
    return current if current in ("Succeeded", "Failed") else None


def helm_binary() -> str:
    """Return the helm executable: the local cluster's cached build, else `helm` on PATH."""
    from twinmq.localcluster.binaries import find

    try:
        return str(find("helm"))
    except FileNotFoundError:
        found = shutil.which("helm")
        if found is None:
            raise RuntimeError("helm not found: run `make cluster-binaries`") from None
        return found


def helm(kubeconfig: str, *args: str, timeout: float = 180) -> str:
    """Run helm against the test cluster; return stdout."""
    home = "/tmp/twinmq-e2e-helm"
    env = dict(
        os.environ,
        KUBECONFIG=kubeconfig,
        HELM_CACHE_HOME=f"{home}/cache",
        HELM_CONFIG_HOME=f"{home}/config",
        HELM_DATA_HOME=f"{home}/data",
    )
    proc = subprocess.run(
        [helm_binary(), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def client_pod(name: str, script: str, *args: str) -> Obj:
    """Return a run-once pod that executes a Python `script` with the project's image."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "twinmq-e2e-client"}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {"name": "client", "image": IMAGE, "command": ["python", "-c", script, *args]}
            ],
        },
    }


AMQP_PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"AMQP\\x00\\x00\\x09\\x01")
        head = sock.recv(7)
        assert head[:1] == b"\\x01", (target, head)  # a method frame: connection.start
        print("reached", target, flush=True)
"""
"""A client that reaches each HOST:PORT argument and reads the broker's connection.start."""


def kubectl_binary() -> str:
    """The local cluster's kubectl, else `kubectl` on PATH."""
    from twinmq.localcluster.binaries import find

    try:
        return str(find("kubectl"))
    except FileNotFoundError:
        found = shutil.which("kubectl")
        if found is None:
            pytest.skip("no kubectl: run `make cluster-binaries`")
        return found


def kubectl(cluster: Cluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`kubectl ARGS` with this venv's console scripts (the plugin) first on PATH."""
    scripts = Path(sys.executable).parent
    if not (scripts / "kubectl-twinmq").exists():
        pytest.skip("kubectl-twinmq is not installed: pip install -e .")
    env = dict(
        os.environ,
        KUBECONFIG=cluster.kubeconfig,
        PATH=f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return subprocess.run(
        [kubectl_binary(), *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def plugin(cluster: Cluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`kubectl twinmq ARGS`."""
    return kubectl(cluster, "twinmq", *args, timeout=timeout)
