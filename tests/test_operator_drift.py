"""Drift detection (operator/drift.py): a repair is told from a no-op apply, a first apply
and a spec change, by the API server's answers alone."""

from __future__ import annotations

from typing import Any

from twinmq.operator.drift import Applied, applied, key, repair

MANAGER = "twinmq-operator"
DESIRED = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "orders"}, "spec": {}}


def answer(uid: str, ours: str, others: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """An apply's answer: the operator's entry changed at `ours`, kubectl's at `others`."""
    return {
        "metadata": {
            "uid": uid,
            "managedFields": [
                {"manager": "kubectl-edit", "operation": "Update", "time": others},
                {"manager": MANAGER, "operation": "Update", "time": "2026-01-01T00:00:09Z"},
                {"manager": MANAGER, "operation": "Apply", "time": ours},
            ],
        }
    }


def test_the_operators_apply_entry_is_read_not_its_update_or_anothers() -> None:
    state = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    assert state.uid == "u1" and state.changed == "2026-01-01T00:00:05Z"
    assert key(DESIRED) == "Service/orders"


def test_a_no_op_apply_is_no_repair_even_when_someone_else_wrote_meanwhile() -> None:
    before = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    after = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z", others="2026-01-01T00:01Z"),
                    MANAGER)  # fmt: skip
    assert repair(before, after) is None


def test_a_deleted_object_recreated_is_a_repair() -> None:
    before = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    after = applied(DESIRED, answer("u2", "2026-01-01T00:02:00Z"), MANAGER)
    assert repair(before, after) == "recreated"


def test_an_edited_object_set_back_is_a_repair() -> None:
    before = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    after = applied(DESIRED, answer("u1", "2026-01-01T00:02:00Z"), MANAGER)
    assert repair(before, after) == "restored"


def test_a_first_apply_and_a_changed_desired_state_are_no_repair() -> None:
    first = applied(DESIRED, answer("u1", "2026-01-01T00:00:05Z"), MANAGER)
    assert repair(None, first) is None
    grown = {**DESIRED, "spec": {"ports": [{"port": 5672}]}}
    updated = applied(grown, answer("u1", "2026-01-01T00:02:00Z"), MANAGER)
    assert repair(first, updated) is None
    assert repair(first, Applied("u1", first.changed, first.desired)) is None
