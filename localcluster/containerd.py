"""containerd for the real node (`TWINMQ_NODE=kubelet`): its config, images and containers.

Debian's containerd 1.6 and runc (installed by `make cluster`), configured to keep
everything under the cluster's state folder (`.cluster/containerd/`): socket, state,
and the image store (`root`, kept by `cluster-down` so that images are imported once).
Two settings matter on these machines (docs/local-cluster.md):

- ``restrict_oom_score_adj``: root here lacks CAP_SYS_RESOURCE; without it every sandbox
  fails with "can't get final child's PID from pipe: EOF";
- ``netns_mounts_under_state_dir``: pod network namespaces are bind-mounted under our
  state folder (inside the node's private mount namespace), not in /run/netns.

The sandbox ("pause") image is a ten-line static Go program packed here as an OCI archive.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from twinmq.localcluster.binaries import cache_dir
from twinmq.localcluster.layout import Layout

NAMESPACE = "k8s.io"
"""containerd's namespace for everything the CRI plugin (the kubelet) uses."""
PAUSE_IMAGE = "registry.k8s.io/pause:twinmq"
CNI_BIN = Path("/usr/lib/cni")
PACKAGES = ("containerd", "runc")
"""Debian packages of the real node besides the cluster's own (installed when missing)."""
DISABLED_PLUGINS = (
    # `opt` would create /opt/containerd on the host; the others are unused snapshotters.
    "io.containerd.internal.v1.opt",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
)

PAUSE_SOURCE = """\
package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

// Sleep until SIGINT/SIGTERM; reap any child that ends up here.
func main() {
\tsignals := make(chan os.Signal, 8)
\tsignal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
\tfor sig := range signals {
\t\tif sig != syscall.SIGCHLD {
\t\t\tos.Exit(0)
\t\t}
\t\tfor {
\t\t\tpid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
\t\t\tif pid <= 0 || err != nil {
\t\t\t\tbreak
\t\t\t}
\t\t}
\t}
}
"""


def socket(layout: Layout) -> Path:
    """containerd's gRPC socket."""
    return layout.containerd / "containerd.sock"


def config_path(layout: Layout) -> Path:
    """Where `write_config` puts containerd's config."""
    return layout.containerd / "config.toml"


def cni_conf_dir(layout: Layout) -> Path:
    """The CNI network configuration the CRI plugin reads."""
    return layout.cni / "net.d"


def config_text(layout: Layout) -> str:
    """Return containerd's config.toml (version 2) for the real node (pure)."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    disabled = ", ".join(f'"{p}"' for p in DISABLED_PLUGINS)
    return f"""\
version = 2
root = "{layout.containerd / "root"}"
state = "{layout.containerd / "state"}"
disabled_plugins = [{disabled}]

[grpc]
  address = "{socket(layout)}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{cni_conf_dir(layout)}"
  max_conf_num = 1
"""


def cni_conflist(plugin: dict[str, object]) -> dict[str, object]:
    """Wrap one CNI plugin configuration (the node agent's bridge + host-local) as the
    network list the CRI plugin reads (pure)."""
    inner = {k: v for k, v in plugin.items() if k not in ("cniVersion", "name")}
    return {"cniVersion": plugin["cniVersion"], "name": plugin["name"], "plugins": [inner]}


def write_config(layout: Layout) -> None:
    """Write containerd's config and the CNI network list."""
    from twinmq.localcluster.nodeagent.runtime import cni_config

    layout.containerd.mkdir(parents=True, exist_ok=True)
    config_path(layout).write_text(config_text(layout))
    conf_dir = cni_conf_dir(layout)
    conf_dir.mkdir(parents=True, exist_ok=True)
    conflist = cni_conflist(cni_config(layout))
    (conf_dir / "10-twinmq.conflist").write_text(json.dumps(conflist, indent=2) + "\n")


def argv(layout: Layout) -> list[str]:
    """containerd's command line."""
    return ["containerd", "--config", str(config_path(layout))]


def ctr(layout: Layout, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ctr` against our containerd, in the CRI's namespace."""
    cmd = ["ctr", "--address", str(socket(layout)), "--namespace", NAMESPACE, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


def ready(layout: Layout) -> bool:
    """Whether containerd answers on its socket."""
    return socket(layout).exists() and ctr(layout, "version", check=False).returncode == 0


# -- images ----------------------------------------------------------------------------------


def archive_digest(archive: Path) -> str:
    """Return the digest of the (single) manifest an OCI archive's index names."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise ValueError(f"{archive}: no index.json")
        index = json.load(member)
    return str(index["manifests"][0]["digest"])


def image_digests(layout: Layout) -> dict[str, str]:
    """Return {reference: digest} of the images containerd holds."""
    lines = ctr(layout, "images", "ls").stdout.splitlines()[1:]
    return {words[0]: words[2] for words in (line.split() for line in lines) if len(words) > 2}


def import_image(layout: Layout, archive: Path, references: list[str]) -> bool:
    """Import an OCI archive and tag it as each of `references`, unless every reference
    already points at the archive's manifest. Return whether it imported."""
    digest = archive_digest(archive)
    held = image_digests(layout)
    if all(held.get(ref) == digest for ref in references):
        return False
    before = set(held)
    # Unpacked into the overlayfs snapshotter, where the CRI runs containers from.
    ctr(layout, "images", "import", "--digests", "--snapshotter", "overlayfs", str(archive))
    # `--digests` names it import-<date>@sha256:...; whatever the archive's own name, tag it.
    imported = [ref for ref, d in image_digests(layout).items() if d == digest]
    source = next((r for r in imported if r not in before), imported[0])
    for ref in references:
        if ref != source:
            ctr(layout, "images", "tag", "--force", source, ref)
    for ref in imported:
        if ref not in references and ref.startswith("import-"):
            ctr(layout, "images", "rm", ref, check=False)
    return True


def _goarch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _blob(blobs: dict[str, bytes], data: bytes, media_type: str) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _tar_bytes(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A reproducible tar of {name: (content, mode)} (mtime 0, owner root)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (content, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(content), mode, 0
            tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


def oci_archive(entrypoint: str, binary: bytes, reference: str, arch: str) -> bytes:
    """Return an OCI image archive with one file, `/<entrypoint>`, run as the image's
    entrypoint (pure; reproducible)."""
    blobs: dict[str, bytes] = {}
    layer = _tar_bytes({entrypoint: (binary, 0o755)})
    compressed = gzip.compress(layer, mtime=0)
    layer_desc = _blob(blobs, compressed, "application/vnd.oci.image.layer.v1.tar+gzip")
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {"Entrypoint": [f"/{entrypoint}"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    config_type = "application/vnd.oci.image.config.v1+json"
    config_desc = _blob(blobs, json.dumps(config, sort_keys=True).encode(), config_type)
    manifest_type = "application/vnd.oci.image.manifest.v1+json"
    manifest = {
        "schemaVersion": 2,
        "mediaType": manifest_type,
        "config": config_desc,
        "layers": [layer_desc],
    }
    manifest_desc = _blob(blobs, json.dumps(manifest, sort_keys=True).encode(), manifest_type)
    manifest_desc["annotations"] = {
        "io.containerd.image.name": reference,
        "org.opencontainers.image.ref.name": reference.rsplit(":", 1)[1],
    }
    index = {"schemaVersion": 2, "manifests": [manifest_desc]}
    files = {f"blobs/sha256/{d.split(':', 1)[1]}": (data, 0o644) for d, data in blobs.items()}
    files["oci-layout"] = (b'{"imageLayoutVersion":"1.0.0"}', 0o644)
    files["index.json"] = (json.dumps(index, sort_keys=True).encode(), 0o644)
    return _tar_bytes(files)


def pause_archive() -> Path:
    """Build (once, cached by source) the pause image's OCI archive; return its path."""
    key = hashlib.sha256(PAUSE_SOURCE.encode()).hexdigest()[:12]
    target = cache_dir() / f"pause-{key}" / "pause.tar"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="twinmq-pause-") as work:
        src = Path(work)
        (src / "go.mod").write_text("module twinmq.local/pause\n\ngo 1.21\n")
        (src / "main.go").write_text(PAUSE_SOURCE)
        env = dict(os.environ, CGO_ENABLED="0", GOWORK="off", GOFLAGS="-buildvcs=false")
        cmd = ["nice", "-n", "10", "go", "build", "-trimpath", "-ldflags", "-s -w", "-o", "pause"]
        subprocess.run(cmd, cwd=src, env=env, check=True, capture_output=True)
        binary = (src / "pause").read_bytes()
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(oci_archive("pause", binary, PAUSE_IMAGE, _goarch()))
    tmp.replace(target)
    return target


# -- containers ------------------------------------------------------------------------------


def live_tasks(layout: Layout) -> dict[str, tuple[int, str]]:
    """Return {container id: (pid, status)} of the tasks that are RUNNING or PAUSED."""
    lines = ctr(layout, "tasks", "ls", check=False).stdout.splitlines()[1:]
    rows = (line.split() for line in lines)
    return {w[0]: (int(w[1]), w[2]) for w in rows if len(w) > 2 and w[2] in ("RUNNING", "PAUSED")}


def pod_containers(
    layout: Layout, namespace: str, pod: str, kind: str = "container"
) -> dict[str, str]:
    """Return {container name: containerd id} of a pod's live app containers, or with
    `kind="sandbox"` its live sandbox (keyed by the pod's name). The kubelet keeps exited
    containers (and sandboxes) beside their replacements: only those with a live task count."""
    tasks = live_tasks(layout)
    found: dict[str, str] = {}
    selector = f'labels."io.kubernetes.pod.name"=={pod}'
    for container_id in ctr(layout, "containers", "ls", "-q", selector).stdout.split():
        if container_id not in tasks:
            continue
        info = ctr(layout, "containers", "info", container_id, check=False)
        if info.returncode != 0:
            continue
        labels = json.loads(info.stdout).get("Labels") or {}
        if (
            labels.get("io.kubernetes.pod.namespace") == namespace
            and labels.get("io.kubernetes.pod.name") == pod
            and labels.get("io.cri-containerd.kind") == kind
        ):
            found[labels.get("io.kubernetes.container.name", pod)] = container_id
    return found


def task_pids(layout: Layout, container_id: str) -> list[int]:
    """Return the host pids of every process of a running container (empty if none)."""
    proc = ctr(layout, "tasks", "ps", container_id, check=False)
    if proc.returncode != 0:
        return []
    return [int(line.split()[0]) for line in proc.stdout.splitlines()[1:] if line.split()]


def sandbox_pid(layout: Layout, namespace: str, pod: str) -> int | None:
    """Return the host pid of the pod's sandbox (its pause process; in the pod's network
    namespace), or None when the pod has no live sandbox."""
    sandboxes = pod_containers(layout, namespace, pod, kind="sandbox")
    if not sandboxes:
        return None
    return live_tasks(layout)[next(iter(sandboxes.values()))][0]


def remove_all(layout: Layout) -> int:
    """Kill and delete every task and container (sandboxes included); return how many."""
    ids = ctr(layout, "containers", "ls", "-q", check=False).stdout.split()
    for container_id in ids:
        ctr(layout, "tasks", "kill", "--signal", "SIGKILL", container_id, check=False)
    for container_id in ids:
        ctr(layout, "tasks", "delete", "--force", container_id, check=False)
        ctr(layout, "containers", "delete", container_id, check=False)
    return len(ids)


def remove_state(layout: Layout) -> None:
    """Remove containerd's state folder and socket; the image store (`root`) stays."""
    shutil.rmtree(layout.containerd / "state", ignore_errors=True)
    socket(layout).unlink(missing_ok=True)
