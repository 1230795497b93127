"""Start, find and stop the local cluster's long-running processes by pid file."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from twinmq.localcluster.layout import Layout


def _pid_file(layout: Layout, name: str) -> Path:
    return layout.pids / f"{name}.pid"


def read_pid(layout: Layout, name: str) -> int | None:
    """Return the live pid of daemon `name`, or None when it is not running."""
    path = _pid_file(layout, name)
    try:
        pid_text, start = path.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    return pid if process_start_time(pid) == start else None


def process_start_time(pid: int) -> str | None:
    """Return the kernel start time of `pid` (guards against pid reuse), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return fields[19]


def start(
    layout: Layout,
    name: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
) -> int:
    """Start `argv` as daemon `name` (own session, log in logs/<name>.log) unless running."""
    existing = read_pid(layout, name)
    if existing is not None:
        return existing
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.pids.mkdir(parents=True, exist_ok=True)
    log = (layout.logs / f"{name}.log").open("ab")
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ if env is None else env),
        cwd=layout.root,
    )
    log.close()
    started = process_start_time(proc.pid) or "0"
    _pid_file(layout, name).write_text(f"{proc.pid} {started}\n")
    return proc.pid


def stop(layout: Layout, name: str, timeout: float = 10.0) -> bool:
    """Stop daemon `name`: SIGTERM, then SIGKILL after `timeout`. Return whether it ran."""
    pid = read_pid(layout, name)
    _pid_file(layout, name).unlink(missing_ok=True)
    if pid is None:
        return False
    terminate(pid, timeout)
    return True


def terminate(pid: int, timeout: float) -> None:
    """Send SIGTERM to `pid`, then SIGKILL if it is still alive after `timeout` seconds."""
    start_time = process_start_time(pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_start_time(pid) != start_time:
            return
        _reap(pid)
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    _reap(pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def pause(layout: Layout, name: str) -> int:
    """SIGSTOP daemon `name` (e.g. to make the API server unresponsive); return its pid."""
    pid = read_pid(layout, name)
    if pid is None:
        raise RuntimeError(f"{name} is not running")
    os.kill(pid, signal.SIGSTOP)
    return pid


def resume(layout: Layout, name: str) -> int:
    """SIGCONT daemon `name`; return its pid."""
    pid = read_pid(layout, name)
    if pid is None:
        raise RuntimeError(f"{name} is not running")
    os.kill(pid, signal.SIGCONT)
    return pid
