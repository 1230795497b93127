"""The cgroup freezer of a container: freeze and thaw every process of its cgroup at once.

What `runc pause` does, done from the host on the cgroup a process is in, so it needs
neither the API server nor the kubelet: cgroup v2's `cgroup.freeze` (1 / 0) when the
process has a cgroup of its own in the v2 hierarchy (also on these hybrid hosts), else
cgroup v1's `freezer.state` (FROZEN / THAWED). Unlike SIGSTOP, a frozen process cannot see or handle
anything: its timers, sockets and signals all wait until it is thawed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from twinmq.localcluster.kubelet import cgroup_mounts


@dataclass(frozen=True)
class Freezer:
    """The control file of one cgroup's freezer and what to write to it."""

    path: Path
    frozen: str
    thawed: str


def freezer_of(proc_cgroup: str, mountinfo: str) -> Freezer | None:
    """Return the freezer of the cgroup described by a /proc/<pid>/cgroup text, given the
    host's /proc/self/mountinfo (pure). v2 wins when the process is in a cgroup of its own
    there (runc joins one on hybrid hosts too): v2 lets SIGKILL through to frozen processes,
    v1 holds it until the thaw, so a paused pod could not even be deleted."""
    v1: str | None = None
    v2: str | None = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "freezer" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and controllers == "":
            v2 = path
    v2_mounts = cgroup_mounts(mountinfo, ("cgroup2",))
    if v2 is not None and v2 != "/" and v2_mounts:
        return Freezer(v2_mounts[0] / v2.lstrip("/") / "cgroup.freeze", "1", "0")
    if v1 is not None:
        for line in mountinfo.splitlines():
            left, _, right = line.partition(" - ")
            fields = right.split()
            if fields[:1] == ["cgroup"] and "freezer" in fields[-1].split(","):
                mount = Path(left.split()[4])
                return Freezer(mount / v1.lstrip("/") / "freezer.state", "FROZEN", "THAWED")
    return None


def _freezer(pid: int) -> Freezer:
    found = freezer_of(
        Path(f"/proc/{pid}/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
    )
    if found is None:
        raise RuntimeError(f"process {pid} is in no cgroup with a freezer")
    return found


def set_frozen(pid: int, frozen: bool, timeout: float = 10.0) -> Path:
    """Freeze (or thaw) the cgroup of process `pid` and wait until the kernel says it is
    done (v1 passes through FREEZING); return the control file."""
    freezer = _freezer(pid)
    want = freezer.frozen if frozen else freezer.thawed
    freezer.path.write_text(want)
    deadline = time.monotonic() + timeout
    while freezer.path.read_text().strip() != want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{freezer.path} did not become {want}")
        time.sleep(0.05)  # the kernel finishes freezing asynchronously
    return freezer.path


def thaw_all(top: Path) -> list[Path]:
    """Thaw every frozen cgroup at or under `top` (so that `cluster-down` can kill what a
    test left frozen: v1 holds even SIGKILL until the thaw); return those thawed."""
    thawed = []
    for name, thaw in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        for control in sorted(top.rglob(name), key=lambda p: len(p.parts)):  # parents first
            if control.read_text().strip() != thaw:
                control.write_text(thaw)
                thawed.append(control)
    return thawed
