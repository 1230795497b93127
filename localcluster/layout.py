"""Where the local cluster keeps its state, and the fixed addresses and ports it uses.

Everything machine-global (the bridge, the routes, the iptables chain, the
network namespaces) carries the `twinmq` prefix so that `cluster-down` removes
exactly what `cluster` made, and nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

POD_CIDR = "10.244.0.0/16"
"""All pod addresses; a blackhole route covers it, so no pod address can be routed off the host."""
NODE_POD_CIDR = "10.244.0.0/24"
"""The single node's pod subnet, on the bridge (more specific than the blackhole)."""
GATEWAY_IP = "10.244.0.1"
"""The bridge's address: the node's InternalIP, where the API server and CoreDNS listen."""
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
BRIDGE = "twinmq0"
NETNS_PREFIX = "twinmq-"
GUARD_CHAIN = "TWINMQ-GUARD"
NODE_NAME = "twinmq-node"
STORAGE_CLASS = "twinmq-local"
VOLUME_PROVISIONER = "twinmq.io/process-node"

ETCD_CLIENT_PORT = 23790
ETCD_PEER_PORT = 23800
APISERVER_PORT = 6443
CONTROLLER_MANAGER_PORT = 10257
SCHEDULER_PORT = 10259
KUBE_PROXY_METRICS_PORT = 10249
KUBE_PROXY_HEALTHZ_PORT = 10256
COREDNS_READY_PORT = 18181
NODE_AGENT_HEALTH_PORT = 10248
NODE_AGENT_API_PORT = 10250
"""The node agent's kubelet-style HTTPS endpoint on the bridge address (container logs)."""

KUBELET_HEALTH_PORT = NODE_AGENT_HEALTH_PORT
"""The kubelet's healthz on 127.0.0.1 (the same port: only one node runs at a time)."""
KUBELET_API_PORT = NODE_AGENT_API_PORT
CGROUP_PARENT = "twinmq"
"""The folder under each cgroup v1 controller that holds everything the kubelet runs."""

NODE_MODES = ("agent", "kubelet")
"""`kubelet`: a real kubelet + containerd running the project's image (default); `agent`:
the process-backed node agent, the fallback for machines that cannot run them."""


def node_mode() -> str:
    """Return the node `make cluster` runs: `$TWINMQ_NODE` (`kubelet`, the default, or the
    `agent` fallback)."""
    mode = os.environ.get("TWINMQ_NODE") or "kubelet"
    if mode not in NODE_MODES:
        raise ValueError(f"TWINMQ_NODE={mode!r}: expected one of {', '.join(NODE_MODES)}")
    return mode


OWNER_FILE = Path("/run/twinmq-localcluster.owner")
"""Machine-global marker naming the state directory of the cluster that owns the network set-up."""


def repo_root() -> Path:
    """Return the repository root (the folder holding pyproject.toml)."""
    here = Path(__file__).resolve().parent
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").exists():
            return candidate
    return Path.cwd()


@dataclass(frozen=True)
class Layout:
    """Paths of one local cluster's runtime state (default: `.cluster/` in the repository)."""

    root: Path

    @classmethod
    def default(cls) -> Layout:
        """Return the layout under `$TWINMQ_CLUSTER_DIR`, else `<repo>/.cluster`."""
        env = os.environ.get("TWINMQ_CLUSTER_DIR")
        return cls(Path(env).resolve() if env else repo_root() / ".cluster")

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig written by `make cluster`."""
        return self.root / "kubeconfig"

    @property
    def logs(self) -> Path:
        """One log file per component, plus one per pod container under `pods/`."""
        return self.root / "logs"

    @property
    def pki(self) -> Path:
        """CA, serving certificate, service-account keys and the admin token."""
        return self.root / "pki"

    @property
    def pids(self) -> Path:
        """One pid file per control-plane daemon."""
        return self.root / "pids"

    @property
    def etcd_data(self) -> Path:
        """etcd's data directory (removed by cluster-down)."""
        return self.root / "etcd"

    @property
    def node(self) -> Path:
        """The node agent's state: one folder per pod (pids, exit codes, volumes)."""
        return self.root / "node"

    @property
    def volumes(self) -> Path:
        """Directories backing PersistentVolumes; they outlive the pods that use them."""
        return self.root / "volumes"

    @property
    def cni(self) -> Path:
        """host-local IPAM state and the CNI network configuration."""
        return self.root / "cni"

    @property
    def containerd(self) -> Path:
        """containerd's config, socket, state and root (the image store, kept by cluster-down)."""
        return self.root / "containerd"

    @property
    def kubelet(self) -> Path:
        """The kubelet's config, root directory and masked sysctl copies."""
        return self.root / "kubelet"

    @property
    def etc(self) -> Path:
        """Generated configuration (Corefile, token file)."""
        return self.root / "etc"
