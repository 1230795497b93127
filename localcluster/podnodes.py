"""The node that runs the pods, as the fault tools see it: one interface, two kinds.

`for_layout(layout)` picks the kind the cluster was started with (`.cluster/node-mode`):

- `KubeletNode` (`TWINMQ_NODE=kubelet`): containers found through containerd (labels of
  the CRI plugin, live tasks only); kill signals every process of the container's task;
  pause freezes the container's cgroup (`freezer.py`); the pod's network namespace is
  its sandbox's (the pause process's).
- `AgentNode` (the node agent, `TWINMQ_NODE=agent`): the agent's own records; kill and
  pause signal the container's process group (no cgroups there: SIGSTOP/SIGCONT); the
  network namespace is the agent's named one.

Both act on the host only (processes, cgroups, namespaces), never through the API server,
so they keep working while it is down.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Protocol

from twinmq.localcluster import containerd, freezer
from twinmq.localcluster.layout import Layout
from twinmq.localcluster.nodeagent.runtime import Runtime, netns_name


class PodNotFound(LookupError):
    """No live sandbox or container of that pod on the node."""


class PodNode(Protocol):
    """What the fault tools need from the node that runs the pods."""

    component: str
    """The daemon whose stop is a node restart (pods keep running without it)."""

    def signal(
        self, namespace: str, name: str, sig: signal.Signals, container: str | None
    ) -> list[int]:
        """Send `sig` to the processes of a pod's containers; return the pids."""
        ...

    def freeze(self, namespace: str, name: str, frozen: bool) -> list[int]:
        """Pause (or resume) every container of a pod; return the pids it holds."""
        ...

    def netns(self, namespace: str, name: str) -> str:
        """Return a path naming the pod's network namespace (for `nsenter --net=`)."""
        ...

    def container_pid(self, namespace: str, name: str, container: str) -> int | None:
        """Return the main pid of a running container, or None."""
        ...


class KubeletNode:
    """The real node: the kubelet and containerd."""

    component = "kubelet"

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def _containers(self, namespace: str, name: str, container: str | None) -> dict[str, str]:
        found = containerd.pod_containers(self.layout, namespace, name)
        chosen = {c: i for c, i in found.items() if container is None or c == container}
        if not chosen:
            raise PodNotFound(f"no running container of pod {namespace}/{name} in containerd")
        return chosen

    def signal(
        self, namespace: str, name: str, sig: signal.Signals, container: str | None
    ) -> list[int]:
        """Send `sig` to every process of each container's task (pids from containerd)."""
        signalled = []
        for container_id in self._containers(namespace, name, container).values():
            for pid in containerd.task_pids(self.layout, container_id):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
                signalled.append(pid)
        return signalled

    def freeze(self, namespace: str, name: str, frozen: bool) -> list[int]:
        """Freeze (or thaw) each container's cgroup. Thawing a pod whose containers have
        all ended since (killed while frozen) does nothing, as SIGCONT to no process."""
        held = []
        if frozen:
            containers = self._containers(namespace, name, None)
        else:
            containers = containerd.pod_containers(self.layout, namespace, name)
        for container_id in containers.values():
            pids = containerd.task_pids(self.layout, container_id)
            if pids:
                freezer.set_frozen(pids[0], frozen)
                held += pids
        return held

    def netns(self, namespace: str, name: str) -> str:
        """The network namespace of the pod's live sandbox (its pause process's)."""
        pid = containerd.sandbox_pid(self.layout, namespace, name)
        if pid is None:
            raise PodNotFound(f"no live sandbox of pod {namespace}/{name} in containerd")
        return f"/proc/{pid}/ns/net"

    def container_pid(self, namespace: str, name: str, container: str) -> int | None:
        """The container's task pid (containerd's `tasks ls`)."""
        found = containerd.pod_containers(self.layout, namespace, name).get(container)
        task = containerd.live_tasks(self.layout).get(found or "")
        return None if task is None else task[0]


class AgentNode:
    """The node agent (the process-backed stand-in for the kubelet)."""

    component = "node-agent"

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.runtime = Runtime(layout)

    def pod_uid(self, namespace: str, name: str) -> str:
        """Return the uid of the pod's live sandbox (newest if several)."""
        found = []
        for uid in self.runtime.sandboxes():
            path = self.runtime.pod_dir(uid) / "sandbox.json"
            if not path.exists():
                continue
            record = json.loads(path.read_text())
            if record.get("namespace") == namespace and record.get("name") == name:
                found.append((path.stat().st_mtime, uid))
        if not found:
            raise PodNotFound(f"no sandbox for pod {namespace}/{name} on the node agent")
        return max(found)[1]

    def signal(
        self, namespace: str, name: str, sig: signal.Signals, container: str | None
    ) -> list[int]:
        """Send `sig` to each container's process group."""
        uid = self.pod_uid(namespace, name)
        pids = []
        for c in self.runtime.container_names(uid):
            if container is not None and c != container:
                continue
            pid = self.runtime.pid(uid, c)
            if pid is not None and self.runtime.signal(uid, c, sig):
                pids.append(pid)
        return pids

    def freeze(self, namespace: str, name: str, frozen: bool) -> list[int]:
        """SIGSTOP (or SIGCONT) each container's process group: the agent has no cgroups."""
        return self.signal(namespace, name, signal.SIGSTOP if frozen else signal.SIGCONT, None)

    def netns(self, namespace: str, name: str) -> str:
        """The agent's named network namespace of the pod."""
        return f"/run/netns/{netns_name(self.pod_uid(namespace, name))}"

    def container_pid(self, namespace: str, name: str, container: str) -> int | None:
        """The container's process-group leader."""
        return self.runtime.pid(self.pod_uid(namespace, name), container)


def for_layout(layout: Layout) -> PodNode:
    """The node of the cluster under `layout`, by the mode it was started with."""
    from twinmq.localcluster.cluster import running_mode

    return KubeletNode(layout) if running_mode(layout) == "kubelet" else AgentNode(layout)


def _in_netns(netns: str, *argv: str) -> str:
    cmd = ["nsenter", f"--net={netns}", "--", *argv]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def eth0(netns: str) -> tuple[str, str]:
    """Return (the host-side veth, the IPv4 address) of eth0 in a pod's network namespace."""
    (link,) = json.loads(_in_netns(netns, "ip", "-j", "link", "show", "eth0"))
    (addr,) = json.loads(_in_netns(netns, "ip", "-j", "-4", "addr", "show", "eth0"))
    peer = str(link["link_index"])
    for iface in Path("/sys/class/net").iterdir():
        try:
            if (iface / "ifindex").read_text().strip() == peer:
                return iface.name, str(addr["addr_info"][0]["local"])
        except OSError:
            continue  # another pod's veth vanishing while we look (EINVAL, ENOENT)
    raise PodNotFound(f"host side of {netns}'s eth0 (ifindex {peer}) not found")
