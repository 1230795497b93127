"""What Kubernetes reports of a broker's process: the evidence that an active broker is gone.

A broker always starts passive, so once the process that was serving as active
has stopped (pod deleted, container terminated or waiting, container restarted)
nothing serves as that active any more, and the operator need not wait for its
Lease to lapse. Pure functions of the pod object; `main.py` remembers which
process it saw serving.
"""

from __future__ import annotations

from typing import Any

BROKER_CONTAINER = "broker"


def broker_process(pod: dict[str, Any] | None) -> str | None:
    """`<pod uid>/<restart count>` of the broker container while Kubernetes reports it
    running; None when there is no pod or the container is not running."""
    if pod is None:
        return None
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    status = next((s for s in statuses if s.get("name") == BROKER_CONTAINER), None)
    if status is None or "running" not in (status.get("state") or {}):
        return None
    return f"{pod['metadata']['uid']}/{int(status.get('restartCount') or 0)}"


def process_gone(pod: dict[str, Any] | None, seen_serving: str | None) -> bool:
    """Whether the process seen serving (`broker_process` then; None: not seen) is gone.

    A pod being deleted still counts as running until its container stops: it may
    still serve during its grace period.
    """
    current = broker_process(pod)
    if current is None:
        return True
    return seen_serving is not None and current != seen_serving
