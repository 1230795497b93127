"""`make cluster` / `make cluster-down`: the local control plane, its node agent and its network.

Run ``python -m twinmq.localcluster.cluster up|down|status``. `up` is
idempotent: components already running are left alone. `down` stops what
`up` started (by pid file), removes the pods' processes and network
namespaces, kube-proxy's rules, the host network guard, and the cluster's
etcd data; certificates and logs stay.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinmq.localcluster import (
    binaries,
    containerd,
    daemons,
    freezer,
    hostnet,
    kubelet,
    s3server,
)
from twinmq.localcluster.kubeapi import KubeApi
from twinmq.localcluster.layout import (
    APISERVER_PORT,
    CGROUP_PARENT,
    CLUSTER_DOMAIN,
    CONTROLLER_MANAGER_PORT,
    COREDNS_READY_PORT,
    DNS_SERVICE_IP,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    GATEWAY_IP,
    KUBE_PROXY_HEALTHZ_PORT,
    KUBE_PROXY_METRICS_PORT,
    KUBELET_HEALTH_PORT,
    NODE_AGENT_HEALTH_PORT,
    NODE_MODES,
    NODE_NAME,
    OWNER_FILE,
    POD_CIDR,
    SCHEDULER_PORT,
    SERVICE_CIDR,
    STORAGE_CLASS,
    VOLUME_PROVISIONER,
    Layout,
    node_mode,
    repo_root,
)
from twinmq.localcluster.pki import ADMIN_USER, admin_token, ensure_pki, kubeconfig
from twinmq.localcluster.versions import BINARIES
from twinmq.testing import waiting

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
POLICY_ENGINE = "kube-router"
"""The NetworkPolicy engine: kube-router's firewall controller (iptables + ipset on the
host), started last: it reads its Node object at start and exits without it."""
POLICY_ENGINE_CHAIN = "KUBE-ROUTER-FORWARD"
"""kube-router's chain in FORWARD: there once its first sync has run."""
NODES = {
    "agent": ("node-agent",),
    "kubelet": (kubelet.NS_COMPONENT, "containerd", "kubelet", "volume-provisioner"),
}
"""The daemons of each node mode (layout.NODE_MODES)."""


def components(mode: str) -> tuple[str, ...]:
    """Return the daemons of a cluster with node `mode`, in start order (`down`: reverse)."""
    return (*CONTROL_PLANE, *NODES[mode], "kube-proxy", "coredns", POLICY_ENGINE)


COMPONENTS = components("agent")
"""The default cluster's daemons, in start order."""
ALL_COMPONENTS = tuple(dict.fromkeys((*components("agent"), *components("kubelet"))))
"""Every daemon of either mode (what `down` stops, whatever mode started them)."""


def running_mode(layout: Layout) -> str:
    """Return the node mode the cluster under `layout` was started with (default agent)."""
    path = layout.root / "node-mode"
    return path.read_text().strip() if path.exists() else "agent"


def _say(message: str) -> None:
    print(f"[cluster] {message}", flush=True)


def api_url() -> str:
    """Return the API server's address as seen from the host and from pods."""
    return f"https://{GATEWAY_IP}:{APISERVER_PORT}"


def kubeconfig_text(layout: Layout) -> str:
    """Return the admin kubeconfig (static bearer token, cluster CA embedded)."""
    config = kubeconfig(layout, api_url(), ADMIN_USER, {"token": admin_token(layout)})
    return json.dumps(config, indent=2) + "\n"


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    layout: Layout,
    component: str | None = None,
) -> None:
    """`twinmq.testing.waiting.wait_for` on a daemon of the cluster: given its `component`,
    stop early if it exits; a failure carries the component's log tail."""

    def tail() -> str:
        log = layout.logs / f"{component}.log"
        if component is None or not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-25:])

    def done() -> bool:
        if check():
            return True
        if component is not None and daemons.read_pid(layout, component) is None:
            raise RuntimeError(f"{component} exited while waiting for {what}\n{tail()}")
        return False

    try:
        waiting.wait_for(what, done, timeout, interval=0.5)
    except TimeoutError as exc:
        raise RuntimeError(f"{exc}\n{tail()}") from None


def _http_ok(url: str, token: str | None = None, ca: Path | None = None) -> bool:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    if url.startswith("https") and ca is None:
        context = ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _venv_python() -> str:
    return sys.executable


@dataclass(frozen=True)
class ControlPlane:
    """Where etcd and the API server listen and how the API server authorizes: the local
    cluster's by default; tests/apiserver.py's API server (loopback, free ports, RBAC only)
    passes its own."""

    address: str = GATEWAY_IP
    apiserver_port: int = APISERVER_PORT
    etcd_client_port: int = ETCD_CLIENT_PORT
    etcd_peer_port: int = ETCD_PEER_PORT
    authorization: str = "Node,RBAC"
    service_cidr: str = SERVICE_CIDR


LOCAL_PLANE = ControlPlane()


def _argv(layout: Layout, component: str, plane: ControlPlane = LOCAL_PLANE) -> list[str]:
    pki = layout.pki
    kubeconfig = str(layout.kubeconfig)
    etcd_url = f"http://127.0.0.1:{plane.etcd_client_port}"
    peer_url = f"http://127.0.0.1:{plane.etcd_peer_port}"
    if component == "etcd":
        return [
            str(binaries.find("etcd")),
            "--name=twinmq-local",
            f"--data-dir={layout.etcd_data}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=twinmq-local={peer_url}",
            "--listen-metrics-urls=",
            "--unsafe-no-fsync",
            "--quota-backend-bytes=2147483648",
        ]
    if component == "kube-apiserver":
        return [
            str(binaries.find("kube-apiserver")),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={plane.address}",
            f"--advertise-address={plane.address}",
            f"--secure-port={plane.apiserver_port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            f"--requestheader-client-ca-file={pki / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--authorization-mode={plane.authorization}",
            f"--service-cluster-ip-range={plane.service_cidr}",
            f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            "--profiling=false",
            "--event-ttl=30m",
        ]
    if component == "kube-controller-manager":
        return [
            str(binaries.find("kube-controller-manager")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={CONTROLLER_MANAGER_PORT}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--use-service-account-credentials=true",
            f"--cluster-cidr={POD_CIDR}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--leader-elect=false",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller",
            "--concurrent-gc-syncs=5",
            "--profiling=false",
        ]
    if component == "kube-scheduler":
        return [
            str(binaries.find("kube-scheduler")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={SCHEDULER_PORT}",
            "--leader-elect=false",
            "--profiling=false",
        ]
    if component == "kube-proxy":
        return [
            str(binaries.find("kube-proxy")),
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={NODE_NAME}",
            f"--cluster-cidr={POD_CIDR}",
            "--proxy-mode=iptables",
            f"--bind-address={GATEWAY_IP}",
            f"--metrics-bind-address=127.0.0.1:{KUBE_PROXY_METRICS_PORT}",
            f"--healthz-bind-address=127.0.0.1:{KUBE_PROXY_HEALTHZ_PORT}",
            f"--nodeport-addresses={GATEWAY_IP}/32",
            "--conntrack-max-per-core=0",
            "--iptables-sync-period=5s",
            "--iptables-min-sync-period=0s",
            "--profiling=false",
        ]
    if component == "coredns":
        return [str(binaries.find("coredns")), "-conf", str(layout.etc / "Corefile")]
    if component == POLICY_ENGINE:
        return [
            str(binaries.find(POLICY_ENGINE)),
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={NODE_NAME}",
            # Only the NetworkPolicy firewall: the bridge plugin routes, kube-proxy proxies.
            # (Its reported flaws are in the other two: docs/security.md.)
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--run-loadbalancer=false",
            "--enable-cni=false",
            "--enable-ipv6=false",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Its health server listens on every address (":port"): off. Readiness is its
            # chain in FORWARD (`_policy_engine_ready`); the metrics port is off by default.
            "--health-port=0",
            "--iptables-sync-period=1m",
            "--v=1",
        ]
    if component == kubelet.NS_COMPONENT:
        return kubelet.namespace_argv(layout)
    if component == "containerd":
        return kubelet.in_namespace(layout, containerd.argv(layout))
    if component == "kubelet":
        return kubelet.in_namespace(layout, kubelet.argv(layout))
    if component == "volume-provisioner":
        return [
            _venv_python(),
            "-m",
            "twinmq.localcluster.provisioner",
            f"--kubeconfig={kubeconfig}",
            f"--state-dir={layout.root}",
        ]
    if component == "node-agent":
        return [
            _venv_python(),
            "-m",
            "twinmq.localcluster.nodeagent",
            f"--kubeconfig={kubeconfig}",
            f"--state-dir={layout.root}",
        ]
    raise KeyError(component)


COREFILE = """\
.:53 {{
    bind {gateway}
    errors
    ready 127.0.0.1:{ready}
    kubernetes {domain} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} twinmq-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
"""
"""No `forward`: names outside the cluster are never resolved, so nothing leaves the host."""


def bootstrap_objects() -> list[dict[str, Any]]:
    """Return the objects `up` applies: DNS Service and endpoints, default StorageClass."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "kube-dns",
                "namespace": "kube-system",
                "labels": {"k8s-app": "kube-dns"},
            },
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                ],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-host",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "twinmq-localcluster",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [GATEWAY_IP], "conditions": {"ready": True}}],
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ],
        },
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": VOLUME_PROVISIONER,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        },
    ]


def object_path(obj: dict[str, Any]) -> str:
    """Return the API path of a namespaced or cluster-scoped object (pure)."""
    group_version = str(obj["apiVersion"])
    base = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    meta = obj["metadata"]
    plural = {
        "Service": "services",
        "EndpointSlice": "endpointslices",
        "StorageClass": "storageclasses",
    }[str(obj["kind"])]
    if meta.get("namespace"):
        return f"{base}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"
    return f"{base}/{plural}/{meta['name']}"


def _apply_bootstrap(layout: Layout) -> None:
    """Server-side apply the bootstrap objects (idempotent)."""
    kube = KubeApi(str(layout.kubeconfig))
    for obj in bootstrap_objects():
        kube.apply(object_path(obj), obj, manager="twinmq-localcluster")


def _claim_owner(layout: Layout) -> None:
    if OWNER_FILE.exists():
        owner = OWNER_FILE.read_text().strip()
        if (
            owner != str(layout.root)
            and Path(owner).exists()
            and any(daemons.read_pid(Layout(Path(owner)), c) is not None for c in ALL_COMPONENTS)
        ):
            raise SystemExit(
                f"another local cluster ({owner}) owns this machine's cluster network; "
                f"stop it first with `make cluster-down` there"
            )
    OWNER_FILE.write_text(f"{layout.root}\n")


def preflight(mode: str = "agent") -> list[str]:
    """Return what is missing on this machine to run the local cluster (empty when ready)."""
    problems = []
    if mode == "kubelet":
        for tool in ("containerd", "runc", "ctr", "nsenter", "mount"):
            if shutil.which(tool) is None:
                problems.append(f"`{tool}` not found (apt-get install containerd runc)")
    if os.geteuid() != 0:
        problems.append("must run as root (network namespaces, bridge, iptables)")
    for tool in ("ip", "iptables", "ipset", "openssl", "conntrack", "unshare", "setsid"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` not found (apt-get install iproute2 iptables ipset openssl)")
    for plugin in ("bridge", "host-local", "loopback"):
        if not (Path("/usr/lib/cni") / plugin).exists():
            problems.append(
                f"CNI plugin {plugin} missing (apt-get install containernetworking-plugins)"
            )
    return problems


PLUGIN = "kubectl-twinmq"
"""The project's kubectl plugin (a console script of this package)."""


def plugin_script() -> Path | None:
    """The `kubectl-twinmq` installed with this Python (the venv running the cluster), else
    the one on PATH."""
    beside = Path(sys.executable).parent / PLUGIN
    if beside.exists():
        return beside
    found = shutil.which(PLUGIN)
    return None if found is None else Path(found)


def write_env(layout: Layout) -> None:
    """Link the cached kubectl and helm, and the project's kubectl plugin, into `.cluster/bin`
    and write `.cluster/env` to source (then `kubectl twinmq` works)."""
    bin_dir = layout.root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    targets: dict[str, Path | None] = {PLUGIN: plugin_script()}
    for name in ("kubectl", "helm"):
        try:
            targets[name] = binaries.find(name)
        except FileNotFoundError:
            targets[name] = None
    for name, target in targets.items():
        if target is None:
            continue
        link = bin_dir / name
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    (layout.root / "env").write_text(
        f"export KUBECONFIG={layout.kubeconfig}\nexport PATH={bin_dir}:$PATH\n"
    )


HOST_PACKAGES = (
    "containernetworking-plugins",
    "iproute2",
    "iptables",
    "ipset",
    "conntrack",
    "openssl",
)
"""Debian packages the local cluster needs on the host."""


def ensure_host_packages(mode: str = "agent") -> None:
    """Install the Debian packages the cluster needs when any tool is missing (as root)."""
    if not preflight(mode) or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    packages = [*HOST_PACKAGES, *(containerd.PACKAGES if mode == "kubelet" else ())]
    _say(f"installing {' '.join(packages)} from Debian's packages")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(install, env=env, check=False)


def up(layout: Layout, mode: str = "agent") -> None:
    """Start every component of a cluster with node `mode` that is not running yet; write
    the kubeconfig."""
    started = time.monotonic()
    if mode not in NODE_MODES:
        raise ValueError(mode)
    running = any(daemons.read_pid(layout, c) is not None for c in ALL_COMPONENTS)
    if running and running_mode(layout) != mode:
        raise SystemExit(
            f"the cluster runs with TWINMQ_NODE={running_mode(layout)}: `make cluster-down` first"
        )
    ensure_host_packages(mode)
    problems = preflight(mode)
    if problems:
        raise SystemExit("cannot start the local cluster:\n  " + "\n  ".join(problems))
    node = NODES[mode]
    built_here = {binary.name for binary in BINARIES}
    for component in components(mode):
        if component in built_here:
            binaries.find(component)
    layout.root.mkdir(parents=True, exist_ok=True)
    _claim_owner(layout)
    (layout.root / "node-mode").write_text(f"{mode}\n")
    for folder in (layout.logs, layout.etc, layout.node, layout.volumes, layout.cni):
        folder.mkdir(parents=True, exist_ok=True)
    ensure_pki(layout)
    layout.kubeconfig.write_text(kubeconfig_text(layout))
    layout.kubeconfig.chmod(0o600)
    (layout.etc / "Corefile").write_text(
        COREFILE.format(
            gateway=GATEWAY_IP,
            ready=COREDNS_READY_PORT,
            domain=CLUSTER_DOMAIN,
            kubeconfig=layout.kubeconfig,
        )
    )
    hostnet.setup(layout)
    write_env(layout)
    if mode == "kubelet":
        kubelet.prepare(layout, api_url())
    token = admin_token(layout)
    ca = layout.pki / "ca.crt"

    checks: dict[str, Callable[[], bool]] = {
        "etcd": lambda: _http_ok(f"http://127.0.0.1:{ETCD_CLIENT_PORT}/health"),
        "kube-apiserver": lambda: _http_ok(f"{api_url()}/readyz", token, ca),
        "kube-controller-manager": lambda: _http_ok(
            f"https://127.0.0.1:{CONTROLLER_MANAGER_PORT}/healthz"
        ),
        "kube-scheduler": lambda: _http_ok(f"https://127.0.0.1:{SCHEDULER_PORT}/healthz"),
        "node-agent": lambda: _http_ok(f"http://127.0.0.1:{NODE_AGENT_HEALTH_PORT}/readyz"),
        kubelet.NS_COMPONENT: lambda: kubelet.namespace_ready(layout),
        "containerd": lambda: containerd.ready(layout),
        "kubelet": lambda: _http_ok(f"http://127.0.0.1:{KUBELET_HEALTH_PORT}/healthz"),
        "volume-provisioner": lambda: True,
        "kube-proxy": lambda: _http_ok(f"http://127.0.0.1:{KUBE_PROXY_HEALTHZ_PORT}/healthz"),
        "coredns": lambda: _http_ok(f"http://127.0.0.1:{COREDNS_READY_PORT}/ready"),
        POLICY_ENGINE: _policy_engine_ready,
    }
    kube = KubeApi(str(layout.kubeconfig))
    for component in components(mode):
        if component == node[0]:
            _apply_bootstrap(layout)
        if component == POLICY_ENGINE:
            wait_for(
                f"node {NODE_NAME} registered (the policy engine reads it at start)",
                lambda: kube.get(f"/api/v1/nodes/{NODE_NAME}") is not None,
                120,
                layout,
                node[-1],
            )
        t0 = time.monotonic()
        was_running = daemons.read_pid(layout, component) is not None
        daemons.start(layout, component, _argv(layout, component))
        wait_for(component, checks[component], 120, layout, component)
        if mode == "kubelet":
            # Also when already running: a new `make image` is imported (content-cached).
            kubelet.after_ready(layout, component, repo_root())
        verb = "already running" if was_running else f"ready in {time.monotonic() - t0:.1f}s"
        _say(f"{component}: {verb}")
    wait_for(
        "the default namespace's service account and root CA (controller-manager)",
        lambda: (
            kube.get("/api/v1/namespaces/default/serviceaccounts/default") is not None
            and kube.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt") is not None
        ),
        60,
        layout,
        "kube-controller-manager",
    )
    if mode == "kubelet":
        wait_for(f"node {NODE_NAME} Ready", lambda: _node_ready(kube), 120, layout, "kubelet")
    _say(f"cluster up in {time.monotonic() - started:.1f}s; export KUBECONFIG={layout.kubeconfig}")


def _policy_engine_ready() -> bool:
    return _ok_quietly(["iptables", "-w", "-S", POLICY_ENGINE_CHAIN])


def _ok_quietly(cmd: Sequence[str]) -> bool:
    return subprocess.run(list(cmd), capture_output=True, check=False).returncode == 0


def _node_ready(kube: KubeApi) -> bool:
    node = kube.get(f"/api/v1/nodes/{NODE_NAME}") or {}
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def down(layout: Layout) -> None:
    """Stop everything `up` started, remove pods' processes/netns and the host network set-up."""
    if not layout.root.exists():
        _say("nothing to stop")
        return
    if running_mode(layout) == "kubelet":
        # A test may have left a container frozen (faults.pause_pod): v1 would hold even
        # SIGKILL until it is thawed; and a frozen container cannot be stopped gracefully.
        mountinfo = Path("/proc/self/mountinfo").read_text()
        for mount in kubelet.cgroup_mounts(mountinfo, ("cgroup", "cgroup2")):
            for control in freezer.thaw_all(mount / CGROUP_PARENT):
                _say(f"thawed {control.parent}")
        for problem in kubelet.stop(layout):
            _say(f"WARNING: {problem}")
        _say("kubelet node: stopped, containers, cgroups and state removed")
    if s3server.stop_daemon(layout):  # the store `make demo` started (a host process)
        _say(f"{s3server.DAEMON}: stopped")
    for component in reversed(ALL_COMPONENTS):
        if daemons.stop(layout, component, timeout=10):
            _say(f"{component}: stopped")
    # The pods outlive the node agent by design; remove them now.
    from twinmq.localcluster.nodeagent.runtime import Runtime

    removed = Runtime(layout).remove_all()
    if removed:
        _say(f"removed {removed} pod sandbox(es)")
    try:
        kube_proxy = binaries.find("kube-proxy")
    except FileNotFoundError:
        kube_proxy = None
    if kube_proxy is not None:
        subprocess.run(
            [str(kube_proxy), "--cleanup", "--proxy-mode=iptables"],
            capture_output=True,
            check=False,
        )
    hostnet.remove_kube_chains()
    hostnet.remove_policy_engine_sets()
    hostnet.teardown(layout)
    for folder in (layout.etcd_data, layout.node, layout.cni, layout.volumes, layout.pids):
        shutil.rmtree(folder, ignore_errors=True)
    if OWNER_FILE.exists() and OWNER_FILE.read_text().strip() == str(layout.root):
        OWNER_FILE.unlink()
    (layout.root / "node-mode").unlink(missing_ok=True)
    _say("cluster down")


def status(layout: Layout) -> int:
    """Print each component's state; return 0 when all are running."""
    missing = 0
    mode = running_mode(layout)
    _say(f"node: {mode}")
    for component in components(mode):
        pid = daemons.read_pid(layout, component)
        missing += pid is None
        _say(f"{component:24} {'pid ' + str(pid) if pid else 'stopped'}")
    return 1 if missing else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `up`, `down` or `status`."""
    parser = argparse.ArgumentParser(description="TwinMQ's local Kubernetes")
    parser.add_argument("command", choices=["up", "down", "status"])
    args = parser.parse_args(argv)
    layout = Layout.default()
    if args.command == "up":
        up(layout, node_mode())
        return 0
    if args.command == "down":
        down(layout)
        return 0
    return status(layout)


if __name__ == "__main__":
    sys.exit(main())
