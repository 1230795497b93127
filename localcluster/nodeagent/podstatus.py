"""Pod phase, restart decisions and container status objects (pure functions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

BACKOFF_INITIAL = 10.0
BACKOFF_MAX = 300.0


def rfc3339(timestamp: float) -> str:
    """Return a Kubernetes timestamp (second precision, UTC)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def should_restart(policy: str, exit_code: int) -> bool:
    """Return whether a container that exited with `exit_code` restarts under `policy`."""
    if policy == "Always":
        return True
    if policy == "OnFailure":
        return exit_code != 0
    return False


def restart_delay(restart_count: int) -> float:
    """Return the back-off before restart number `restart_count + 1`.

    The first restart is immediate; then 10 s, 20 s, 40 s ... capped at 5 min (kubelet's curve).
    """
    if restart_count == 0:
        return 0.0
    return float(min(BACKOFF_INITIAL * 2 ** (restart_count - 1), BACKOFF_MAX))


@dataclass(frozen=True)
class ContainerView:
    """What the phase computation needs to know about one container."""

    running: bool
    exit_code: int | None
    will_restart: bool


def pod_phase(containers: Sequence[ContainerView], initialized: bool) -> str:
    """Return Pending, Running, Succeeded or Failed as the kubelet would."""
    if not initialized or not containers:
        return "Pending"
    if any(c.running or c.will_restart for c in containers):
        if all(c.exit_code is None and not c.running for c in containers):
            return "Pending"
        return "Running"
    if all(c.exit_code is not None for c in containers):
        return "Succeeded" if all(c.exit_code == 0 for c in containers) else "Failed"
    return "Pending"


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    """Return a `state` object for a waiting container."""
    body = {"reason": reason}
    if message:
        body["message"] = message
    return {"waiting": body}


def running(started: float) -> dict[str, Any]:
    """Return a `state` object for a running container."""
    return {"running": {"startedAt": rfc3339(started)}}


def terminated(
    code: int, reason: str, started: float, finished: float, message: str = ""
) -> dict[str, Any]:
    """Return a `state` object for a terminated container."""
    body: dict[str, Any] = {
        "exitCode": code,
        "reason": reason,
        "startedAt": rfc3339(started),
        "finishedAt": rfc3339(finished),
    }
    if message:
        body["message"] = message
    return {"terminated": body}
