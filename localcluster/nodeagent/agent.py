"""The node agent's main loop: the Node and its Lease, the pod watch, the volume provisioner.

Stopping the agent (SIGTERM) leaves the pods' processes running, as a kubelet
restart does; a new agent adopts them from the state on disk.
"""

from __future__ import annotations

import base64
import http.server
import logging
import os
import signal
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from twinmq.localcluster.kubeapi import ApiError, KubeApi
from twinmq.localcluster.layout import (
    GATEWAY_IP,
    NODE_AGENT_API_PORT,
    NODE_AGENT_HEALTH_PORT,
    NODE_NAME,
    NODE_POD_CIDR,
    Layout,
)
from twinmq.localcluster.nodeagent.images import CommandMap
from twinmq.localcluster.nodeagent.logserver import serve_logs
from twinmq.localcluster.nodeagent.runtime import Runtime
from twinmq.localcluster.nodeagent.volumes import IssuedToken, TokenSource
from twinmq.localcluster.nodeagent.worker import PodWorker
from twinmq.localcluster.provisioner import provision_loop
from twinmq.localcluster.versions import KUBERNETES_VERSION

log = logging.getLogger("twinmq.nodeagent")

LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 10


def issued_token(answer: dict[str, Any]) -> IssuedToken:
    """The token of a TokenRequest answer, with its expiry and the lifetime granted."""
    expires = datetime.fromisoformat(answer["status"]["expirationTimestamp"].replace("Z", "+00:00"))
    return IssuedToken(
        token=str(answer["status"]["token"]),
        expires_at=expires.timestamp(),
        lifetime=float(answer["spec"]["expirationSeconds"]),
    )


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
            "daemonEndpoints": {"kubeletEndpoint": {"Port": NODE_AGENT_API_PORT}},
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "osImage": "TwinMQ process-backed node",
                "kernelVersion": os.uname().release,
                "kubeletVersion": KUBERNETES_VERSION,
                "kubeProxyVersion": KUBERNETES_VERSION,
                "containerRuntimeVersion": "twinmq-process://0.1",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
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
        {
            "type": t,
            "status": s,
            "reason": r,
            "message": m,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        for t, s, r, m in rows
    ]


class Agent:
    """Registers the Node, keeps it alive, and runs a PodWorker per pod bound to it."""

    def __init__(self, layout: Layout, kubeconfig: str, node_name: str = NODE_NAME) -> None:
        self.layout = layout
        self.node_name = node_name
        self.kube = KubeApi(kubeconfig)
        self.runtime = Runtime(layout)
        self.commands = CommandMap.for_current_venv()
        self.bin_path = f"{self.commands.bin_dir}:/usr/local/bin:/usr/bin:/bin"
        self.workers: dict[str, PodWorker] = {}
        self.workers_lock = threading.Lock()
        self.stop = threading.Event()
        self.ready = threading.Event()
        (layout.logs / "pods").mkdir(parents=True, exist_ok=True)

    # -- Cluster protocol for the workers ---------------------------------------------------

    def _must_get(self, path: str, what: str) -> dict[str, Any]:
        obj = self.kube.get(path)
        if obj is None:
            raise KeyError(f"{what} not found")
        return obj

    def secret(self, namespace: str, name: str) -> dict[str, bytes]:
        """Return a Secret's decoded data; KeyError when it does not exist."""
        obj = self._must_get(
            f"/api/v1/namespaces/{namespace}/secrets/{name}", f"secret {namespace}/{name}"
        )
        data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
        return data

    def config_map(self, namespace: str, name: str) -> dict[str, bytes]:
        """Return a ConfigMap's data as bytes; KeyError when it does not exist."""
        obj = self._must_get(
            f"/api/v1/namespaces/{namespace}/configmaps/{name}", f"configmap {namespace}/{name}"
        )
        data = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def token(self, source: TokenSource) -> IssuedToken:
        """Return a token for a projected volume (TokenRequest API), bound to its pod as the
        kubelet's are."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [source.audience] if source.audience else [],
                "expirationSeconds": source.expiration_seconds,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                   "name": source.pod_name, "uid": source.pod_uid},
            },
        }  # fmt: skip
        path = f"/api/v1/namespaces/{source.namespace}/serviceaccounts/{source.account}/token"
        try:
            result = self.kube.create(path, body)
        except ApiError as error:
            if error.status == 404:
                raise KeyError(
                    f"serviceaccount {source.namespace}/{source.account} not found"
                ) from None
            raise
        return issued_token(result)

    def claim_path(self, namespace: str, claim: str) -> Path:
        """Return the folder of the PersistentVolume bound to `claim`; KeyError if unbound."""
        pvc = self._must_get(
            f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}",
            f"persistentvolumeclaim {namespace}/{claim}",
        )
        volume = pvc["spec"].get("volumeName")
        if not volume:
            raise KeyError(f"persistentvolumeclaim {namespace}/{claim} is not bound")
        pv = self._must_get(f"/api/v1/persistentvolumes/{volume}", f"volume {volume}")
        host_path = (pv["spec"].get("hostPath") or {}).get("path")
        if not host_path:
            raise ValueError(f"volume {volume} is not a local folder")
        path = Path(host_path)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Patch the pod's status (strategic merge: conditions merge by type)."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/status"
        try:
            self.kube.patch(path, {"status": status}, kind="strategic")
        except ApiError as error:
            if error.status != 404:
                raise

    def finish_delete(self, namespace: str, name: str, uid: str) -> None:
        """Delete the pod object with grace 0 once its processes are gone."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        try:
            self.kube.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", body)
        except ApiError as error:
            if error.status != 409:
                raise

    # -- node --------------------------------------------------------------------------------

    def register(self) -> None:
        """Create or refresh the Node and its Lease."""
        node = node_object(self.node_name)
        node["status"]["conditions"] = node_conditions()
        try:
            self.kube.create("/api/v1/nodes", node)
            log.info("registered node %s", self.node_name)
        except ApiError as error:
            if error.status != 409:
                raise
        self.kube.patch(
            f"/api/v1/nodes/{self.node_name}/status", {"status": node["status"]}, kind="strategic"
        )

    def _renew_lease(self) -> None:
        spec = {
            "holderIdentity": self.node_name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": _now().strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        try:
            self.kube.patch(f"{path}/{self.node_name}", {"spec": spec})
        except ApiError as error:
            if error.status != 404:
                raise
            self.kube.create(path, {"metadata": {"name": self.node_name}, "spec": spec})

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self.stop.is_set():
            try:
                self._renew_lease()
                if beats % 3 == 0:
                    self.kube.patch(
                        f"/api/v1/nodes/{self.node_name}/status",
                        {"status": {"conditions": node_conditions()}},
                        kind="strategic",
                    )
                beats += 1
            except Exception as error:
                log.warning("heartbeat failed: %s", error)
            self.stop.wait(HEARTBEAT_SECONDS)

    # -- pods --------------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.workers_lock:
            self.workers = {u: w for u, w in self.workers.items() if w.thread.is_alive()}
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.deleted()
                elif self.runtime.pod_dir(uid).exists():
                    self.runtime.remove_sandbox(uid)
                return
            if worker is not None:
                worker.update(pod)
                return
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and not (
                pod["metadata"].get("deletionTimestamp")
            ):
                return
            worker = PodWorker(
                pod, self.runtime, self, self.commands, self.layout.logs / "pods", self.bin_path
            )
            self.workers[uid] = worker
            worker.start()

    def _sync(self) -> str:
        """List the node's pods, adopt or start them, clean up orphans; return resourceVersion."""
        listing = self.kube.request(
            "GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={self.node_name}"}
        )
        seen = set()
        for pod in listing.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self._on_pod("MODIFIED", pod)
        for uid in self.runtime.sandboxes():
            if uid not in seen and uid not in self.workers:
                log.info("removing orphan sandbox %s", uid)
                self.runtime.remove_sandbox(uid)
        return str(listing["metadata"]["resourceVersion"])

    def _watch_loop(self) -> None:
        resource_version = ""
        while not self.stop.is_set():
            try:
                if not resource_version:
                    resource_version = self._sync()
                    self.ready.set()
                for event in self.kube.watch(
                    "/api/v1/pods",
                    resource_version,
                    fieldSelector=f"spec.nodeName={self.node_name}",
                ):
                    if self.stop.is_set():
                        return
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        resource_version = ""
                        break
                    resource_version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._on_pod(event["type"], obj)
            except Exception as error:
                log.warning("pod watch failed: %s", error)
                resource_version = ""
                self.stop.wait(1)

    # -- volumes -------------------------------------------------------------------------------

    # -- main --------------------------------------------------------------------------------

    def _serve_health(self) -> http.server.ThreadingHTTPServer:
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                ok = self.path == "/healthz" or (self.path == "/readyz" and agent.ready.is_set())
                self.send_response(200 if ok else 503)
                self.end_headers()
                self.wfile.write(b"ok\n" if ok else b"not ready\n")

            def log_message(self, format: str, *args: Any) -> None:
                return

        server = http.server.ThreadingHTTPServer(("127.0.0.1", NODE_AGENT_HEALTH_PORT), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def run(self) -> None:
        """Run until SIGTERM/SIGINT; pods keep running when the agent stops."""
        server = self._serve_health()
        log_server = serve_logs(
            (GATEWAY_IP, NODE_AGENT_API_PORT),
            self.layout.logs / "pods",
            self.layout.pki,
            lambda ns, pod: any(
                w.namespace == ns and w.name == pod and w.thread.is_alive()
                for w in list(self.workers.values())
            ),
        )
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
            threading.Thread(
                target=provision_loop,
                args=(self.kube, self.layout, self.stop),
                name="volumes",
                daemon=True,
            ),
        ]
        for thread in threads:
            thread.start()
        self.stop.wait()
        server.shutdown()
        log_server.shutdown()
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
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout
    )
    agent = Agent(Layout(args.state_dir.resolve()), args.kubeconfig, args.node_name)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
    agent.run()
    return 0
