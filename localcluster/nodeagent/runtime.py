"""Pod sandboxes (network namespace + CNI) and container processes, on disk and in the kernel.

State lives under ``<state>/node/pods/<pod-uid>/``: ``sandbox.json`` (netns,
pod IP), ``containers/<name>/`` (``pid``, ``exit``, ``restarts``). It is all
the agent needs to adopt running pods after a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from twinmq.localcluster.daemons import process_start_time
from twinmq.localcluster.layout import (
    BRIDGE,
    CLUSTER_DOMAIN,
    DNS_SERVICE_IP,
    GATEWAY_IP,
    NETNS_PREFIX,
    NODE_POD_CIDR,
    Layout,
)

CNI_BIN = Path("/usr/lib/cni")
NETNS_DIR = Path("/var/run/netns")


@dataclass(frozen=True)
class Running:
    """A container process that is alive."""

    pid: int
    started: float


@dataclass(frozen=True)
class Exited:
    """A container process that ended (exit file written by its shim)."""

    code: int
    reason: str
    message: str
    finished: float
    started: float


ContainerState = Running | Exited | None


def netns_name(uid: str) -> str:
    """Return the network namespace name of the pod with `uid`."""
    return NETNS_PREFIX + uid.replace("-", "")[:12]


def cni_config(layout: Layout) -> dict[str, object]:
    """Return the CNI network configuration (bridge + host-local IPAM)."""
    return {
        "cniVersion": "1.0.0",
        "name": "twinmq",
        "type": "bridge",
        "bridge": BRIDGE,
        "isGateway": True,
        "ipMasq": False,
        "hairpinMode": True,
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": NODE_POD_CIDR, "gateway": GATEWAY_IP}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(layout.cni / "ipam"),
        },
    }


def resolv_conf(namespace: str) -> str:
    """Return a pod's resolv.conf (ClusterFirst DNS, the kube-dns Service address)."""
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"nameserver {DNS_SERVICE_IP}\nsearch {search}\noptions ndots:5\n"


class Runtime:
    """Creates and removes sandboxes, starts and signals container processes."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.pods = layout.node / "pods"

    # -- sandboxes -------------------------------------------------------------------------

    def pod_dir(self, uid: str) -> Path:
        """Return the folder holding everything of pod `uid`."""
        return self.pods / uid

    def sandbox(self, uid: str) -> dict[str, str] | None:
        """Return the recorded sandbox of pod `uid` ({netns, ip, ...}) or None."""
        path = self.pod_dir(uid) / "sandbox.json"
        if not path.exists():
            return None
        data: dict[str, str] = json.loads(path.read_text())
        return data

    def ensure_sandbox(self, uid: str, namespace: str, name: str, hostname: str) -> str:
        """Create pod `uid`'s network namespace and wire it with CNI; return the pod IP."""
        existing = self.sandbox(uid)
        netns = netns_name(uid)
        if existing is not None and (NETNS_DIR / netns).exists():
            return existing["ip"]
        pod_dir = self.pod_dir(uid)
        pod_dir.mkdir(parents=True, exist_ok=True)
        if not (NETNS_DIR / netns).exists():
            subprocess.run(["ip", "netns", "add", netns], check=True, capture_output=True)
        subprocess.run(
            ["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"],
            check=True,
            capture_output=True,
        )
        result = self._cni("ADD", uid, netns)
        ip = result["ips"][0]["address"].split("/")[0]
        etc = Path("/etc/netns") / netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(resolv_conf(namespace))
        (etc / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n{ip}\t{hostname}\n"
        )
        record = {"netns": netns, "ip": ip, "namespace": namespace, "name": name}
        (pod_dir / "sandbox.json").write_text(json.dumps(record))
        return ip

    def _cni(self, command: str, uid: str, netns: str) -> dict[str, list[dict[str, str]]]:
        env = dict(
            os.environ,
            CNI_COMMAND=command,
            CNI_CONTAINERID=uid,
            CNI_NETNS=str(NETNS_DIR / netns),
            CNI_IFNAME="eth0",
            CNI_PATH=str(CNI_BIN),
        )
        proc = subprocess.run(
            [str(CNI_BIN / "bridge")],
            input=json.dumps(cni_config(self.layout)),
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"CNI {command} failed: {proc.stdout} {proc.stderr}")
        if command != "ADD":
            return {}
        result: dict[str, list[dict[str, str]]] = json.loads(proc.stdout)
        return result

    def host_veth(self, uid: str) -> str:
        """Return the host-side interface of pod `uid`'s veth pair."""
        netns = netns_name(uid)
        out = subprocess.run(
            ["ip", "netns", "exec", netns, "cat", "/sys/class/net/eth0/iflink"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for iface in Path("/sys/class/net").iterdir():
            try:
                index = (iface / "ifindex").read_text().strip()
            except OSError:
                continue  # another pod's veth vanishing while we look (EINVAL, ENOENT)
            if index == out:
                return iface.name
        raise RuntimeError(f"host side of {netns}'s eth0 not found")

    def remove_sandbox(self, uid: str) -> None:
        """Kill what is left of pod `uid`, release its IP and delete its namespace and state."""
        for container in self.container_names(uid):
            self.kill(uid, container, grace=0)
        netns = netns_name(uid)
        if (NETNS_DIR / netns).exists():
            with contextlib.suppress(RuntimeError):
                self._cni("DEL", uid, netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        self._release_ip(uid)
        shutil.rmtree(self.pod_dir(uid), ignore_errors=True)

    def _release_ip(self, uid: str) -> None:
        ipam = self.layout.cni / "ipam" / "twinmq"
        if not ipam.exists():
            return
        for entry in ipam.iterdir():
            try:
                if entry.read_text().split()[0] == uid:
                    entry.unlink()
            except (OSError, IndexError):
                pass

    def sandboxes(self) -> list[str]:
        """Return the uids of all pods with state on disk."""
        return sorted(p.name for p in self.pods.iterdir()) if self.pods.exists() else []

    def remove_mount_points(self) -> None:
        """Remove the host folders the shims made as mount points, if they are still empty."""
        record = self.layout.root / "mountpoints.txt"
        if not record.exists():
            return
        for line in sorted(set(record.read_text().split()), key=len, reverse=True):
            top = Path(line)
            if not top.is_dir():
                continue
            for folder, _, _ in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only ever removes empty folders
        record.unlink()

    def remove_all(self) -> int:
        """Remove every pod sandbox and stray twinmq network namespace; return how many."""
        uids = self.sandboxes()
        for uid in uids:
            self.remove_sandbox(uid)
        if NETNS_DIR.exists():
            for ns in NETNS_DIR.iterdir():
                if ns.name.startswith(NETNS_PREFIX):
                    subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
                    shutil.rmtree(Path("/etc/netns") / ns.name, ignore_errors=True)
        self.remove_mount_points()
        return len(uids)

    # -- containers ------------------------------------------------------------------------

    def container_dir(self, uid: str, name: str) -> Path:
        """Return the folder of container `name` of pod `uid`."""
        return self.pod_dir(uid) / "containers" / name

    def container_names(self, uid: str) -> list[str]:
        """Return the containers of pod `uid` that have state on disk."""
        folder = self.pod_dir(uid) / "containers"
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    def start(
        self,
        uid: str,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str,
        mounts: Sequence[str],
        log: Path,
        hostname: str = "",
    ) -> None:
        """Start container `name` of pod `uid` through its shim, in the pod's namespaces."""
        state = self.container_dir(uid, name)
        state.mkdir(parents=True, exist_ok=True)
        for stale in ("pid", "exit"):
            (state / stale).unlink(missing_ok=True)
        (state / "started").write_text(str(time.time()))
        shim = [
            "ip",
            "netns",
            "exec",
            netns_name(uid),
            "unshare",
            "--uts",
            sys.executable,
            "-m",
            "twinmq.localcluster.nodeagent.shim",
            "--state",
            str(state),
            "--log",
            str(log),
            "--cwd",
            cwd,
            "--hostname",
            hostname,
            "--record-created",
            str(self.layout.root / "mountpoints.txt"),
        ]
        for mount in mounts:
            shim += ["--mount", mount]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as err:
            # `setsid -f` double-forks: the shim is nobody's child here, never a zombie,
            # and lives on when the agent stops.
            subprocess.run(
                ["setsid", "-f", *shim, "--", *argv],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                check=True,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (state / "pid").exists() or (state / "exit").exists():
                return
            time.sleep(0.02)

    def state(self, uid: str, name: str) -> ContainerState:
        """Return whether container `name` of pod `uid` runs, ended, or never started."""
        folder = self.container_dir(uid, name)
        started = _float(folder / "started")
        exit_file = folder / "exit"
        if exit_file.exists():
            data = json.loads(exit_file.read_text())
            return Exited(
                code=int(data["code"]),
                reason=str(data.get("reason", "Error")),
                message=str(data.get("message", "")),
                finished=float(data.get("finished", time.time())),
                started=started,
            )
        pid = self.pid(uid, name)
        if pid is not None:
            return Running(pid=pid, started=started)
        if (folder / "started").exists():
            # The shim died without writing an exit file (killed with the agent's session?).
            age = time.time() - started
            if age > 10:
                return Exited(137, "Error", "container process lost", time.time(), started)
            return Running(pid=0, started=started)
        return None

    def pid(self, uid: str, name: str) -> int | None:
        """Return the live pid of the container (also its process group), or None."""
        try:
            pid_text, start = (self.container_dir(uid, name) / "pid").read_text().split()
        except (OSError, ValueError):
            return None
        pid = int(pid_text)
        return pid if process_start_time(pid) == start else None

    def signal(self, uid: str, name: str, sig: signal.Signals) -> bool:
        """Send `sig` to the container's process group; return whether it was running."""
        pid = self.pid(uid, name)
        if pid is None:
            return False
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill(self, uid: str, name: str, grace: float) -> None:
        """Stop a container: SIGTERM, then SIGKILL to its process group after `grace` seconds."""
        pid = self.pid(uid, name)
        if pid is None:
            return
        if grace > 0:
            self.signal(uid, name, signal.SIGCONT)
            self.signal(uid, name, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.pid(uid, name) is not None:
                time.sleep(0.05)
        if self.pid(uid, name) is not None:
            self.signal(uid, name, signal.SIGKILL)
            self.signal(uid, name, signal.SIGCONT)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.pid(uid, name) is not None:
                time.sleep(0.02)

    def reset(self, uid: str, name: str) -> None:
        """Forget a container's last run (before restarting it)."""
        folder = self.container_dir(uid, name)
        for stale in ("pid", "exit", "started"):
            (folder / stale).unlink(missing_ok=True)


def _float(path: Path) -> float:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return 0.0
