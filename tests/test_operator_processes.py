"""What Kubernetes reports of a broker's process (`operator/processes.py`), on pod objects."""

from __future__ import annotations

from typing import Any

from twinmq.operator.processes import broker_process, process_gone


def pod(state: str = "running", restarts: int = 0, uid: str = "u1", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, **meta},
        "status": {"containerStatuses": [
            {"name": "audit-ship", "restartCount": 7, "state": {"running": {}}},
            {"name": "broker", "restartCount": restarts, "state": {state: {}}},
        ]},
    }  # fmt: skip


def test_the_broker_process_is_named_by_pod_uid_and_restart_count() -> None:
    assert broker_process(pod(restarts=3)) == "u1/3"


def test_a_process_seen_serving_and_still_running_is_not_gone() -> None:
    assert not process_gone(pod(restarts=3), "u1/3")


def test_a_restarted_container_is_a_gone_process() -> None:
    assert process_gone(pod(restarts=4), "u1/3")


def test_a_recreated_pod_is_a_gone_process() -> None:
    assert process_gone(pod(uid="u2"), "u1/0")


def test_a_terminated_or_waiting_container_and_a_deleted_pod_are_gone() -> None:
    assert process_gone(pod("terminated"), "u1/0")
    assert process_gone(pod("waiting"), None)
    assert process_gone(None, "u1/0")


def test_a_pod_being_deleted_still_counts_while_its_broker_runs() -> None:
    # It may serve during its grace period: only a stopped container counts.
    assert not process_gone(pod(deletionTimestamp="2026-11-23T10:00:00Z"), "u1/0")


def test_without_a_process_seen_serving_only_a_stopped_container_counts() -> None:
    assert not process_gone(pod(restarts=9), None)
