"""The node agent's main loop: the Node and its Lease, the pod watch, the volume provisioner.

Stopping the agent (SIGTERM) leaves the pods' processes running, as a kubelet
restart does; a new agent adopts them from the state on disk.
"""

from __future__ import annotations

import base64
import http.server
import logging
import os
import shutil
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from twinmq.localcluster.layout import (
    GATEWAY_IP,
    NODE_AGENT_HEALTH_PORT,
    NODE_NAME,
    NODE_POD_CIDR,
    STORAGE_CLASS,
    VOLUME_PROVISIONER,
    Layout,
)
from twinmq.localcluster.nodeagent.images import CommandMap
from twinmq.localcluster.nodeagent.runtime import Runtime
from twinmq.localcluster.nodeagent.worker import PodWorker
from twinmq.localcluster.versions import KUBERNETES_VERSION

log = logging.getLogger("twinmq.nodeagent")

LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10


def _now() -> datetime:
    return datetime.now(UTC)


def node_object(name: str) -> dict[str, Any]:
    """Return the Node this agent registers (pure)."""
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "twinmq.io/process-node": "true",
            },
            "annotations": {
                "twinmq.io/note": "process-backed test node standing in for a kubelet",
            },
        },
        "spec": {"podCIDR": NODE_POD_CIDR, "podCIDRs": [NODE_POD_CIDR]},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [
                {"type": "InternalIP", "address": GATEWAY_IP},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "osImage": "TwinMQ process-backed node",
                "kernelVersion": os.uname().release,
                "kubeletVersion": KUBERNETES_VERSION,
                "kubeProxyVersion": KUBERNETES_VERSION,
                "containerRuntimeVersion": "twinmq-process://0.1",
                "machineID": "", "systemUUID": "", "bootID": "",
            },  # fmt: skip
        },
    }


def node_conditions() -> list[dict[str, str]]:
    """Return a healthy node's conditions, stamped now."""
    now = _now().strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = [
        ("Ready", "True", "KubeletReady", "process-backed node agent is posting ready status"),
        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
    ]
    return [
        {"type": t, "status": s, "reason": r, "message": m,
         "lastHeartbeatTime": now, "lastTransitionTime": now}
        for t, s, r, m in rows
    ]  # fmt: skip


class Agent:
    """Registers the Node, keeps it alive, and runs a PodWorker per pod bound to it."""

    def __init__(self, layout: Layout, kubeconfig: str, node_name: str = NODE_NAME) -> None:
        self.layout = layout
        self.node_name = node_name
        self.api_client = config.new_client_from_config(kubeconfig)
        self.core = client.CoreV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self.runtime = Runtime(layout)
        self.commands = CommandMap.for_current_venv()
        self.bin_path = f"{self.commands.bin_dir}:/usr/local/bin:/usr/bin:/bin"
        self.workers: dict[str, PodWorker] = {}
        self.workers_lock = threading.Lock()
        self.stop = threading.Event()
        self.ready = threading.Event()
        (layout.logs / "pods").mkdir(parents=True, exist_ok=True)

    # -- Cluster protocol for the workers ---------------------------------------------------

    def secret(self, namespace: str, name: str) -> dict[str, bytes]:
        """Return a Secret's decoded data; KeyError when it does not exist."""
        try:
            obj = self.core.read_namespaced_secret(name, namespace)
        except ApiException as error:
            if error.status == 404:
                raise KeyError(f"secret {namespace}/{name} not found") from None
            raise
        data = {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
        data.update({k: v.encode() for k, v in (obj.string_data or {}).items()})
        return data

    def config_map(self, namespace: str, name: str) -> dict[str, bytes]:
        """Return a ConfigMap's data as bytes; KeyError when it does not exist."""
        try:
            obj = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as error:
            if error.status == 404:
                raise KeyError(f"configmap {namespace}/{name} not found") from None
            raise
        data = {k: v.encode() for k, v in (obj.data or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.binary_data or {}).items()})
        return data

    def token(self, namespace: str, account: str, expiry: int, audience: str | None) -> str:
        """Return a token for a service account (TokenRequest API)."""
        body = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[audience] if audience else [], expiration_seconds=expiry
            )
        )
        try:
            result = self.core.create_namespaced_service_account_token(account, namespace, body)
        except ApiException as error:
            if error.status == 404:
                raise KeyError(f"serviceaccount {namespace}/{account} not found") from None
            raise
        return str(result.status.token)

    def claim_path(self, namespace: str, claim: str) -> Path:
        """Return the folder of the PersistentVolume bound to `claim`; KeyError if unbound."""
        try:
            pvc = self.core.read_namespaced_persistent_volume_claim(claim, namespace)
        except ApiException as error:
            if error.status == 404:
                raise KeyError(f"persistentvolumeclaim {namespace}/{claim} not found") from None
            raise
        if not pvc.spec.volume_name:
            raise KeyError(f"persistentvolumeclaim {namespace}/{claim} is not bound")
        pv = self.core.read_persistent_volume(pvc.spec.volume_name)
        if pv.spec.host_path is None:
            raise ValueError(f"volume {pv.metadata.name} is not a local folder")
        path = Path(pv.spec.host_path.path)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Patch the pod's status (strategic merge: conditions merge by type)."""
        try:
            self.core.patch_namespaced_pod_status(name, namespace, {"status": status})
        except ApiException as error:
            if error.status != 404:
                raise

    def finish_delete(self, namespace: str, name: str, uid: str) -> None:
        """Delete the pod object with grace 0 once its processes are gone."""
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
        )
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body)
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    # -- node --------------------------------------------------------------------------------

    def register(self) -> None:
        """Create or refresh the Node and its Lease."""
        node = node_object(self.node_name)
        node["status"]["conditions"] = node_conditions()
        try:
            self.core.create_node(node)
            log.info("registered node %s", self.node_name)
        except ApiException as error:
            if error.status != 409:
                raise
        self.core.patch_node_status(self.node_name, {"status": node["status"]})

    def _renew_lease(self) -> None:
        lease_body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.node_name, "namespace": "kube-node-lease"},
            "spec": {
                "holderIdentity": self.node_name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            },
        }
        try:
            self.coordination.patch_namespaced_lease(
                self.node_name, "kube-node-lease", {"spec": lease_body["spec"]}
            )
        except ApiException as error:
            if error.status != 404:
                raise
            self.coordination.create_namespaced_lease("kube-node-lease", lease_body)

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self.stop.is_set():
            try:
                self._renew_lease()
                if beats % 3 == 0:
                    self.core.patch_node_status(
                        self.node_name, {"status": {"conditions": node_conditions()}}
                    )
                beats += 1
            except Exception:
                log.exception("heartbeat failed")
            self.stop.wait(HEARTBEAT_SECONDS)

    # -- pods --------------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.workers_lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None and worker.thread.is_alive():
                    worker.deleted()
                elif self.runtime.pod_dir(uid).exists():
                    self.runtime.remove_sandbox(uid)
                return
            if worker is None:
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and not (
                    self.runtime.pod_dir(uid).exists()
                ):
                    return
                worker = PodWorker(pod, self.runtime, self, self.commands,
                                   self.layout.logs / "pods", self.bin_path)  # fmt: skip
                self.workers[uid] = worker
                worker.start()
            else:
                worker.update(pod)
            self.workers = {u: w for u, w in self.workers.items()
                            if w.thread.is_alive() or u == uid}  # fmt: skip

    def _sync(self) -> str:
        """List the node's pods, adopt or start them, clean up orphans; return resourceVersion."""
        selector = f"spec.nodeName={self.node_name}"
        result = self.api_client.sanitize_for_serialization(
            self.core.list_pod_for_all_namespaces(field_selector=selector)
        )
        seen = set()
        for pod in result.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self._on_pod("MODIFIED", pod)
        for uid in self.runtime.sandboxes():
            if uid not in seen and uid not in self.workers:
                log.info("removing orphan sandbox %s", uid)
                self.runtime.remove_sandbox(uid)
        return str(result["metadata"]["resourceVersion"])

    def _watch_loop(self) -> None:
        resource_version = ""
        while not self.stop.is_set():
            try:
                if not resource_version:
                    resource_version = self._sync()
                    self.ready.set()
                stream = watch.Watch()
                for event in stream.stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={self.node_name}",
                    resource_version=resource_version,
                    timeout_seconds=60,
                    _preload_content=False,
                ):
                    if self.stop.is_set():
                        return
                    obj = event["raw_object"]
                    if event["type"] == "ERROR":
                        resource_version = ""
                        break
                    resource_version = obj["metadata"]["resourceVersion"]
                    self._on_pod(event["type"], obj)
            except ApiException as error:
                if error.status == 410:
                    resource_version = ""
                else:
                    log.warning("pod watch failed: %s", error.reason)
                    self.stop.wait(1)
            except Exception as error:
                log.warning("pod watch failed: %s", error)
                resource_version = ""
                self.stop.wait(1)

    # -- volumes -------------------------------------------------------------------------------

    def _provision_loop(self) -> None:
        while not self.stop.is_set():
            try:
                self._provision_once()
            except Exception:
                log.exception("provisioner failed")
            self.stop.wait(1)

    def _provision_once(self) -> None:
        pvs = {pv.metadata.name: pv for pv in self.core.list_persistent_volume().items}
        for pvc in self.core.list_persistent_volume_claim_for_all_namespaces().items:
            if pvc.spec.storage_class_name != STORAGE_CLASS or pvc.spec.volume_name:
                continue
            name = f"pvc-{pvc.metadata.uid}"
            if name in pvs or pvc.metadata.deletion_timestamp:
                continue
            path = self.layout.volumes / name
            path.mkdir(parents=True, exist_ok=True)
            storage = (pvc.spec.resources.requests or {}).get("storage", "1Gi")
            self.core.create_persistent_volume({
                "apiVersion": "v1", "kind": "PersistentVolume",
                "metadata": {"name": name, "annotations": {
                    "pv.kubernetes.io/provisioned-by": VOLUME_PROVISIONER}},
                "spec": {
                    "capacity": {"storage": storage},
                    "accessModes": pvc.spec.access_modes or ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Delete",
                    "storageClassName": STORAGE_CLASS,
                    "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                    "claimRef": {"namespace": pvc.metadata.namespace, "name": pvc.metadata.name,
                                 "uid": pvc.metadata.uid},
                },
            })  # fmt: skip
            log.info("provisioned %s for %s/%s", name, pvc.metadata.namespace, pvc.metadata.name)
        for pv in pvs.values():
            annotations = pv.metadata.annotations or {}
            if annotations.get("pv.kubernetes.io/provisioned-by") != VOLUME_PROVISIONER:
                continue
            if pv.status.phase == "Released" and pv.spec.persistent_volume_reclaim_policy == "Delete":
                shutil.rmtree(self.layout.volumes / pv.metadata.name, ignore_errors=True)
                try:
                    self.core.delete_persistent_volume(pv.metadata.name)
                except ApiException as error:
                    if error.status != 404:
                        raise

    # -- main --------------------------------------------------------------------------------

    def _serve_health(self) -> http.server.ThreadingHTTPServer:
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                ok = self.path == "/healthz" or (self.path == "/readyz" and agent.ready.is_set())
                self.send_response(200 if ok else 503)
                self.end_headers()
                self.wfile.write(b"ok\n" if ok else b"not ready\n")

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        server = http.server.ThreadingHTTPServer(("127.0.0.1", NODE_AGENT_HEALTH_PORT), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def run(self) -> None:
        """Run until SIGTERM/SIGINT; pods keep running when the agent stops."""
        server = self._serve_health()
        while not self.stop.is_set():
            try:
                self.register()
                break
            except Exception as error:
                log.warning("registering the node failed (%s); retrying", error)
                self.stop.wait(1)
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="pods", daemon=True),
            threading.Thread(target=self._provision_loop, name="volumes", daemon=True),
        ]
        for thread in threads:
            thread.start()
        self.stop.wait()
        server.shutdown()
        with self.workers_lock:
            for worker in self.workers.values():
                worker.stop.set()
        log.info("node agent stopped; pods keep running")


def main(argv: list[str] | None = None) -> int:
    """Command line of the node agent."""
    import argparse

    parser = argparse.ArgumentParser(description="TwinMQ process-backed test node agent")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--node-name", default=NODE_NAME)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stdout)  # fmt: skip
    agent = Agent(Layout(args.state_dir.resolve()), args.kubeconfig, args.node_name)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
    agent.run()
    return 0
