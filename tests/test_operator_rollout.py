"""Rolling updates: the pure planner (`operator/rollout.py`) and the template hash it reads.

A small simulation plays the reconciler: it applies the planned pod deletions and the
switchover, recreates pods from the desired template and brings brokers back, so the
tests follow a whole rollout step by step, as the operator does one reconcile at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from twinmq.operator import builders
from twinmq.operator.builders import ClusterRef, build_pod, pod_revision
from twinmq.operator.failover import OTHER, BrokerView
from twinmq.operator.models import BrokerClusterSpec, BrokerName
from twinmq.operator.rollout import (
    CRASH_LOOP_RESTARTS,
    DeletePod,
    PodView,
    Progress,
    RequestSwitchover,
    RolloutDecision,
    RolloutObservation,
    plan,
    pod_failure,
)

CLUSTER = ClusterRef("orders", "ns", "uid-1")
NAMES: tuple[BrokerName, ...] = ("primary", "backup")


def test_the_template_hash_changes_with_the_image_and_not_otherwise() -> None:
    spec = BrokerClusterSpec()
    first = pod_revision(build_pod(CLUSTER, spec, "primary"))
    assert first == pod_revision(build_pod(CLUSTER, spec, "primary"))
    newer = spec.model_copy(update={"image": "twinmq/twinmq:0.2.0"})
    assert pod_revision(build_pod(CLUSTER, newer, "primary")) != first
    requests = BrokerClusterSpec.model_validate({"requests": {"recover": {"id": "r-1"}}})
    assert pod_revision(build_pod(CLUSTER, requests, "primary")) == first


def test_a_pod_made_before_rolling_updates_is_outdated() -> None:
    pod = build_pod(CLUSTER, BrokerClusterSpec(), "backup")
    del pod["metadata"]["annotations"]
    assert pod_revision(pod) == ""
    assert pod_revision(None) is None


def test_a_generated_secret_holds_the_given_credentials_as_data() -> None:
    credentials = builders.generate_credentials()
    secret = builders.build_secret(CLUSTER, credentials)
    import base64

    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == credentials
    assert builders.generate_credentials()["admin-token"] != credentials["admin-token"]


def container(restarts: int = 0, waiting: str | None = None, exit_code: int = 1) -> dict[str, Any]:
    state = {"waiting": {"reason": waiting, "message": "boom"}} if waiting else {"running": {}}
    return {"status": {"containerStatuses": [{
        "name": "broker", "restartCount": restarts, "state": state,
        "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error"}},
    }]}}  # fmt: skip


def test_pod_failure_reads_image_errors_and_crash_loops_but_not_one_restart() -> None:
    assert pod_failure(None) is None
    assert pod_failure(container()) is None
    assert pod_failure(container(restarts=1, waiting="CrashLoopBackOff")) is None
    assert "ErrImagePull" in (pod_failure(container(waiting="ErrImagePull")) or "")
    looping = pod_failure(container(restarts=CRASH_LOOP_RESTARTS, exit_code=3))
    assert looping is not None and "exit code 3" in looping


# -- a simulated pair under the planner ----------------------------------------------------


@dataclass
class Pair:
    """Two brokers, their pods' revisions, the active; advanced one reconcile at a time."""

    method: str = "Switchover"
    supervised: bool = False
    active: BrokerName | None = "primary"
    epoch: int = 1
    revision: str = "r1"
    running: dict[BrokerName, str] = field(default_factory=lambda: {n: "r1" for n in NAMES})
    up: dict[BrokerName, bool] = field(default_factory=lambda: {n: True for n in NAMES})
    broken: str | None = None  # a revision whose broker never becomes ready
    progress: Progress | None = None
    now: float = 1000.0
    deleted: list[BrokerName] = field(default_factory=list)
    switchovers: list[BrokerName] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    busy: str | None = None
    fenced: frozenset[BrokerName] = frozenset()

    def view(self, name: BrokerName) -> BrokerView:
        if not self.up[name] or self.running[name] == self.broken:
            return BrokerView(name, reachable=False)
        if name == self.active:
            return BrokerView(name, True, "active", self.epoch)
        return BrokerView(name, True, "passive", self.epoch, ready=True, link_connected=True)

    def observe(self) -> RolloutObservation:
        pods = {
            n: PodView(
                present=self.running[n] != "",
                current=self.running[n] == self.revision,
                failing="CrashLoopBackOff: exit 1" if self.running[n] == self.broken else None,
            )
            for n in NAMES
        }
        return RolloutObservation(
            revision=self.revision, pods=pods, brokers={n: self.view(n) for n in NAMES},
            active=self.active, epoch=self.epoch, busy=self.busy, fenced=self.fenced,
            method=self.method, supervised=self.supervised,  # type: ignore[arg-type]
            ready_timeout=300, progress=self.progress, now=self.now,
        )  # fmt: skip

    def step(self) -> RolloutDecision:
        """One reconcile: plan, then let the world react as Kubernetes and decide do."""
        decision = plan(self.observe())
        self.progress = decision.progress
        self.events += [e.reason for e in decision.events]
        for action in decision.actions:
            if isinstance(action, DeletePod):
                self.deleted.append(action.broker)
                self.running[action.broker] = ""  # deleted ...
                if action.broker == self.active:  # ... a deleted active: failover
                    self.active, self.epoch = OTHER[action.broker], self.epoch + 1
            elif isinstance(action, RequestSwitchover):
                self.switchovers.append(action.target)
                self.active, self.epoch = action.target, self.epoch + 2
        for name in NAMES:
            if self.running[name] == "" and not any(
                isinstance(a, DeletePod) and a.broker == name for a in decision.actions
            ):
                self.running[name] = self.revision  # recreated from the desired template
        self.now += 1
        return decision

    def run(self, steps: int = 20) -> RolloutDecision:
        decision = self.step()
        for _ in range(steps):
            if decision.converged or (decision.progress and decision.progress.step == "Stalled"):
                break
            decision = self.step()
        return decision


def test_nothing_happens_while_every_pod_runs_the_desired_template() -> None:
    pair = Pair()
    decision = pair.step()
    assert decision.converged and decision.progress is None and not decision.actions


def test_switchover_rollout_updates_the_passive_first_then_switches_over_then_the_old_active() -> (
    None
):
    pair = Pair(revision="r2")
    decision = pair.run()
    assert decision.converged
    assert pair.deleted == ["backup", "primary"]
    assert pair.switchovers == ["backup"]
    assert pair.running == {"primary": "r2", "backup": "r2"}
    assert pair.active == "backup", "the updated passive ends up active"
    assert decision.progress is not None and decision.progress.step == "Complete"
    assert pair.events.count("RollingUpdate") >= 3


def test_the_active_is_never_touched_before_the_updated_passive_is_ready() -> None:
    pair = Pair(revision="r2")
    pair.step()
    assert pair.deleted == ["backup"]
    pair.up["backup"] = False  # recreated, not back yet
    for _ in range(5):
        decision = pair.step()
        assert not decision.actions
        assert decision.progress is not None and decision.progress.step == "UpdatingPassive"
    assert pair.active == "primary" and pair.running["primary"] == "r1"


def test_a_failing_new_template_stalls_the_rollout_and_the_active_keeps_serving() -> None:
    pair = Pair(revision="r2", broken="r2")
    decision = pair.run()
    assert decision.progress is not None and decision.progress.step == "Stalled"
    assert decision.progress.broker == "backup" and "CrashLoopBackOff" in decision.progress.message
    assert not decision.converged
    assert pair.active == "primary" and pair.running["primary"] == "r1"
    assert pair.events.count("RolloutStalled") == 1
    for _ in range(3):  # stays stalled, posts no more
        assert not pair.step().actions
    assert pair.events.count("RolloutStalled") == 1


def test_reverting_a_stalled_rollout_brings_the_passive_back_to_the_old_template() -> None:
    pair = Pair(revision="r2", broken="r2")
    pair.run()
    pair.revision = "r1"
    decision = pair.run()
    assert decision.converged and pair.running == {"primary": "r1", "backup": "r1"}
    assert pair.active == "primary" and pair.switchovers == []


def test_a_broker_never_ready_stalls_after_the_timeout() -> None:
    pair = Pair(revision="r2")
    pair.step()  # the passive's pod deleted
    pair.step()  # ... and recreated, but its broker never comes back
    pair.up["backup"] = False
    pair.now += 301
    decision = pair.step()
    assert decision.progress is not None and decision.progress.step == "Stalled"
    assert "not ready (caught up) after 300s" in decision.progress.message
    pair.up["backup"] = True  # it came back after all: the rollout goes on
    assert pair.run().converged and pair.active == "backup"


def test_restart_in_place_recreates_the_active_without_a_switchover() -> None:
    pair = Pair(revision="r2", method="RestartInPlace")
    assert pair.run().converged
    assert pair.deleted == ["backup", "primary"] and pair.switchovers == []
    assert pair.active == "backup"


def test_supervised_waits_for_a_manual_promote_before_touching_the_active() -> None:
    pair = Pair(revision="r2", supervised=True)
    for _ in range(5):
        decision = pair.step()
    assert decision.progress is not None and decision.progress.step == "WaitingForSwitchover"
    assert "kubectl twinmq promote" in decision.progress.message
    assert pair.running["primary"] == "r1" and pair.switchovers == []
    pair.active, pair.epoch = "backup", pair.epoch + 2  # the user's promote
    assert pair.run().converged and pair.running["primary"] == "r2"


@pytest.mark.parametrize("why", ["busy", "fenced", "no active"])
def test_nothing_is_deleted_while_roles_move_a_broker_is_fenced_or_no_one_serves(
    why: str,
) -> None:
    pair = Pair(revision="r2")
    if why == "busy":
        pair.busy = "waiting for the promote to backup to finish"
    elif why == "fenced":
        pair.fenced = frozenset({"backup"})
    else:
        pair.up["primary"] = False
    for _ in range(3):
        decision = pair.step()
        assert not decision.actions and not decision.converged
    assert pair.running == {"primary": "r1", "backup": "r1"}


def test_a_restarted_operator_resumes_from_the_recorded_step() -> None:
    pair = Pair(revision="r2")
    pair.step()  # the passive's pod deleted, recreated
    pair.up["backup"] = False
    pair.step()
    recorded = pair.progress
    assert recorded is not None
    fresh = replace(pair, progress=recorded, deleted=[], events=[])  # a new process
    pair.up["backup"] = True
    decision = fresh.run()
    assert decision.converged and fresh.deleted == ["primary"] and fresh.switchovers == ["backup"]
    assert fresh.progress is not None and fresh.progress.since > recorded.since


# -- what the reconciler feeds the planner, and the conditions it reports --------------------


def _views() -> dict[BrokerName, BrokerView]:
    return {
        "primary": BrokerView("primary", True, "active", 1),
        "backup": BrokerView("backup", True, "passive", 1, ready=True, link_connected=True),
    }


def test_the_reconciler_reads_pod_revisions_and_a_pending_request_as_busy() -> None:
    from twinmq.operator.main import observe_rollout
    from twinmq.operator.models import BrokerClusterStatus

    spec = BrokerClusterSpec.model_validate(
        {"requests": {"promote": {"id": "p-1", "broker": "backup"}}}
    )
    status = BrokerClusterStatus(active_broker="primary", epoch=1)
    pods = {n: build_pod(CLUSTER, BrokerClusterSpec(), n) for n in NAMES}
    obs = observe_rollout(CLUSTER, spec, status, pods, _views())  # type: ignore[arg-type]
    assert all(obs.pods[n].current for n in NAMES), "requests are not in the pod template"
    assert obs.busy is not None and "promote" in obs.busy
    newer = spec.model_copy(update={"image": "twinmq/twinmq:0.2.0"})
    status.handled_requests.promote = "p-1"
    obs = observe_rollout(CLUSTER, newer, status, pods, _views())  # type: ignore[arg-type]
    assert obs.busy is None and all(obs.pods[n].outdated for n in NAMES)


def test_conditions_say_reconciling_while_a_rollout_moves_and_stalled_with_the_reason() -> None:
    from twinmq.operator.main import rollout_conditions
    from twinmq.operator.models import RolloutProgress

    def by_type(progress: RolloutProgress | None, refusal: str | None = None) -> dict[str, Any]:
        return {t: (value, reason, message) for t, value, reason, message
                in rollout_conditions(progress, refusal)}  # fmt: skip

    moving = RolloutProgress(revision="r2", step="UpdatingPassive", broker="backup",
                             since="2026-01-01T00:00:00Z", message="waiting")  # fmt: skip
    assert by_type(moving)["Reconciling"][:2] == (True, "UpdatingPassive")
    assert by_type(moving)["Stalled"][0] is False
    stalled = moving.model_copy(update={"step": "Stalled", "message": "ErrImagePull: nope"})
    assert by_type(stalled)["Stalled"] == (True, "RolloutStalled", "ErrImagePull: nope")
    assert by_type(None, "forbidden")["Stalled"][:2] == (True, "StorageResizeRefused")
    assert by_type(None)["Reconciling"][0] is False and by_type(None)["Stalled"][0] is False
