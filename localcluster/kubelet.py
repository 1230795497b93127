"""The real node (`TWINMQ_NODE=kubelet`): a kubelet and containerd in a private mount namespace.

- **Host sysctls stay as they are.** The kubelet rewrites a few at start
  (`MASKED_SYSCTLS`). A holder process (`node-ns`) makes a mount namespace
  (propagation slave: host mounts still show in it) where copies of those
  `/proc/sys` files are bind-mounted over the originals; containerd and the kubelet
  are started inside it (`nsenter`), so their volume mounts (Secrets, projected
  tokens) and the pods' network-namespace mounts stay there too and vanish with it.
- **cgroups:** one `twinmq` folder per cgroup v1 controller (`cgroupRoot: /twinmq`,
  driver cgroupfs); `cluster-down` removes it once the pods are gone.
- **Registration:** a client certificate `system:node:twinmq-node` from the
  cluster's CA; the API server authorizes it with the Node authorizer.
- **Kubelet API** (logs, exec) on the bridge address with the existing serving
  certificate; only clients with a certificate of the cluster's CA get in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import tomllib
from pathlib import Path
from typing import Any

from twinmq.localcluster import binaries, containerd, daemons
from twinmq.localcluster.layout import (
    CGROUP_PARENT,
    CLUSTER_DOMAIN,
    DNS_SERVICE_IP,
    GATEWAY_IP,
    KUBELET_API_PORT,
    KUBELET_HEALTH_PORT,
    NODE_NAME,
    NODE_POD_CIDR,
    Layout,
)
from twinmq.localcluster.pki import kubeconfig

MASKED_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
"""What the kubelet writes at start (under /proc/sys): masked by copies in its namespace."""

CGROUP_ROOT = Path("/sys/fs/cgroup")
NS_COMPONENT = "node-ns"
"""The daemon holding the node's mount namespace."""


def sysctl_copies(layout: Layout) -> Path:
    """The copies of MASKED_SYSCTLS the kubelet writes instead of the host's."""
    return layout.kubelet / "sysctl"


def root_dir(layout: Layout) -> Path:
    """The kubelet's --root-dir (pods' volumes, plugins, checkpoints)."""
    return layout.kubelet / "root"


def namespace_script(layout: Layout) -> str:
    """The holder's shell script: mask the sysctls, say ready, sleep (pure)."""
    lines = ["set -e"]
    for name in MASKED_SYSCTLS:
        copy = sysctl_copies(layout) / name.replace("/", ".")
        lines.append(f"mount --bind {copy} /proc/sys/{name}")
    ready = layout.kubelet / "ns.ready"
    lines += [f"echo $$ > {ready}", "exec sleep infinity"]
    return "\n".join(lines) + "\n"


def namespace_argv(layout: Layout) -> list[str]:
    """The holder of the node's private mount namespace."""
    script = namespace_script(layout)
    return ["unshare", "--mount", "--propagation", "slave", "--", "sh", "-c", script]


def prepare_namespace(layout: Layout) -> None:
    """Copy the host's current values of MASKED_SYSCTLS (what the kubelet will write to)."""
    copies = sysctl_copies(layout)
    copies.mkdir(parents=True, exist_ok=True)
    for name in MASKED_SYSCTLS:
        value = (Path("/proc/sys") / name).read_text()
        (copies / name.replace("/", ".")).write_text(value)
    (layout.kubelet / "ns.ready").unlink(missing_ok=True)


def namespace_ready(layout: Layout) -> bool:
    """Whether the holder has masked the sysctls."""
    return (layout.kubelet / "ns.ready").exists()


def in_namespace(layout: Layout, argv: list[str]) -> list[str]:
    """`argv` run inside the node's mount namespace."""
    pid = daemons.read_pid(layout, NS_COMPONENT)
    if pid is None:
        raise RuntimeError("the node's mount namespace holder is not running")
    return ["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", *argv]


def namespace_inode(pid: int) -> int | None:
    """The inode of a process's mount namespace (None if it is gone)."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def kill_namespace_members(layout: Layout) -> list[int]:
    """SIGKILL every process still in the node's mount namespace (leftover shims, pods);
    return their pids. The namespace is ours: everything in it was started by `up`."""
    record = layout.kubelet / "ns.inode"
    if not record.exists():
        return []
    inode = int(record.read_text())
    if namespace_inode(os.getpid()) == inode:
        return []
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if namespace_inode(pid) == inode:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


# -- cgroups ---------------------------------------------------------------------------------


def cgroup_mounts(mountinfo: str, types: tuple[str, ...] = ("cgroup",)) -> list[Path]:
    """Return the mount points of cgroup hierarchies of `types` (v1: `cgroup`, v2:
    `cgroup2`) in a /proc/self/mountinfo text (pure)."""
    found = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] and right.split()[0] in types:
            found.append(Path(left.split()[4]))
    return found


def setup_cgroups() -> list[Path]:
    """Create `<controller>/twinmq` in every v1 hierarchy (cpuset filled from its parent)."""
    made = []
    for mount in cgroup_mounts(Path("/proc/self/mountinfo").read_text()):
        folder = mount / CGROUP_PARENT
        folder.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            parent = mount / name
            if parent.exists() and not (folder / name).read_text().strip():
                (folder / name).write_text(parent.read_text())
        made.append(folder)
    return made


def remove_cgroups(timeout: float = 10.0) -> list[Path]:
    """Remove every `<hierarchy>/twinmq` tree, deepest first (on a hybrid host the kubelet
    also makes one in the v2 hierarchy); return what is left (busy)."""
    left = []
    for mount in cgroup_mounts(Path("/proc/self/mountinfo").read_text(), ("cgroup", "cgroup2")):
        top = mount / CGROUP_PARENT
        if not top.exists():
            continue
        deadline = time.monotonic() + timeout
        while top.exists():
            for folder, _subdirs, _files in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            if not top.exists() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if top.exists():
            left.append(top)
    return left


# -- kubelet ---------------------------------------------------------------------------------


def config(layout: Layout) -> dict[str, Any]:
    """Return the KubeletConfiguration (pure)."""
    pki = layout.pki
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": GATEWAY_IP,
        "port": KUBELET_API_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": KUBELET_HEALTH_PORT,
        "tlsCertFile": str(pki / "kubelet.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        # Every client already holds a certificate of the cluster's own CA.
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{containerd.socket(layout)}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_PARENT}",
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        # No host search domains or resolvers inside pods: nothing resolves off the host.
        "resolvConf": str(layout.kubelet / "resolv.conf"),
        "podCIDR": NODE_POD_CIDR,
        "podLogsDir": str(layout.logs / "kubelet-pods"),
        "volumePluginDir": str(layout.kubelet / "volume-plugins"),
        "staticPodPath": "",
        # The disk is shared with other work: evict only when it is really full.
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
    }


def node_kubeconfig(layout: Layout, server: str) -> dict[str, Any]:
    """Return the kubelet's kubeconfig: the node's client certificate."""
    credentials = {
        "client-certificate": str(layout.pki / "node-client.crt"),
        "client-key": str(layout.pki / "node-client.key"),
    }
    return kubeconfig(layout, server, f"system:node:{NODE_NAME}", credentials)


def write_config(layout: Layout, server: str) -> None:
    """Write the kubelet's config, kubeconfig and empty resolv.conf."""
    layout.kubelet.mkdir(parents=True, exist_ok=True)
    (layout.kubelet / "config.json").write_text(json.dumps(config(layout), indent=2) + "\n")
    path = layout.kubelet / "kubeconfig"
    path.write_text(json.dumps(node_kubeconfig(layout, server), indent=2) + "\n")
    path.chmod(0o600)
    (layout.kubelet / "resolv.conf").write_text("")
    for folder in (root_dir(layout), layout.logs / "kubelet-pods"):
        folder.mkdir(parents=True, exist_ok=True)


def argv(layout: Layout) -> list[str]:
    """The kubelet's command line."""
    return [
        str(binaries.find("kubelet")),
        f"--config={layout.kubelet / 'config.json'}",
        f"--kubeconfig={layout.kubelet / 'kubeconfig'}",
        f"--root-dir={root_dir(layout)}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={GATEWAY_IP}",
        "--v=1",
    ]


def mounts_under(path: Path, mountinfo: str) -> list[str]:
    """Return the mount points at or under `path` in a mountinfo text (pure)."""
    prefix = str(path).rstrip("/")
    points = [line.split()[4] for line in mountinfo.splitlines() if line.strip()]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


# -- life cycle (called by cluster.py) -------------------------------------------------------

HOST_PATHS = (Path("/run/containerd"), Path("/var/lib/kubelet"), Path("/var/log/containers"))
"""Made on the host whatever the configs say: containerd 1.6's shim sockets and runc state;
the kubelet's device-plugin socket folder and its container-log links (constants)."""


def project_image(root: Path, name: str = "twinmq") -> tuple[Path, list[str]]:
    """Return the project's image archive (`make image`; `make image-audit` for
    `twinmq-audit`) and the references to tag it as: its release tag and `dev` (the e2e
    suite's default image)."""
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    cache = Path(os.environ.get("TWINMQ_IMAGE_CACHE", root / ".cache" / "image"))
    repository = f"docker.io/twinmq/{name}"
    return cache / f"{name}-{version}.tar", [f"{repository}:{version}", f"{repository}:dev"]


def prepare(layout: Layout, server: str) -> None:
    """Before the node starts: configs, sysctl copies, cgroups, the pause image."""
    containerd.write_config(layout)
    write_config(layout, server)
    if daemons.read_pid(layout, NS_COMPONENT) is None:
        prepare_namespace(layout)
    setup_cgroups()
    record = layout.kubelet / "host-paths-created.json"
    created = set(json.loads(record.read_text())) if record.exists() else set()
    created |= {str(path) for path in HOST_PATHS if not path.exists()}
    record.write_text(json.dumps(sorted(created)) + "\n")
    containerd.pause_archive()


def after_ready(layout: Layout, component: str, root: Path) -> None:
    """Once `component` is ready: remember the namespace; load the images into containerd."""
    if component == NS_COMPONENT:
        pid = daemons.read_pid(layout, NS_COMPONENT)
        inode = None if pid is None else namespace_inode(pid)
        if inode is not None:
            (layout.kubelet / "ns.inode").write_text(f"{inode}\n")
    elif component == "containerd":
        archive, references = project_image(root)
        if not archive.exists():
            raise SystemExit(f"{archive} is missing: run `make image` (TWINMQ_NODE=kubelet)")
        images = [(containerd.pause_archive(), [containerd.PAUSE_IMAGE]), (archive, references)]
        audit = project_image(root, "twinmq-audit")
        if audit[0].exists():  # `make image-audit`: the Spark audit's image (JRE + PySpark)
            images.append(audit)
        for path, refs in images:
            started = time.monotonic()
            done = containerd.import_image(layout, path, refs)
            verb = f"imported in {time.monotonic() - started:.1f}s" if done else "already there"
            print(f"[cluster] image {refs[0]}: {verb}", flush=True)


def stop(layout: Layout) -> list[str]:
    """Stop the kubelet, remove every container, stop containerd and the namespace, remove
    cgroups and state; return what could not be removed."""
    daemons.stop(layout, "kubelet", timeout=10)
    if daemons.read_pid(layout, "containerd") is not None:
        containerd.remove_all(layout)
    daemons.stop(layout, "containerd", timeout=10)
    daemons.stop(layout, NS_COMPONENT, timeout=5)
    kill_namespace_members(layout)
    problems = [f"cgroup {p} still busy" for p in remove_cgroups()]
    host_mounts = mounts_under(layout.root, Path("/proc/self/mountinfo").read_text())
    if host_mounts:
        problems.append(f"mounts left on the host under {layout.root}: {host_mounts}")
    else:
        shutil.rmtree(root_dir(layout), ignore_errors=True)
        containerd.remove_state(layout)
    record = layout.kubelet / "host-paths-created.json"
    if record.exists():
        for path in json.loads(record.read_text()):
            shutil.rmtree(path, ignore_errors=True)
        record.unlink()
    for name in ("ns.inode", "ns.ready"):
        (layout.kubelet / name).unlink(missing_ok=True)
    return problems
