"""Rolling updates of the pod template: observations in, one step out, no I/O and no clock.

A change of the pod template (image, resources, settings, probes, audit sidecar) is
detected by its hash (`builders.POD_TEMPLATE_HASH` on each pod). It reaches the pods
passive first: the passive's pod is recreated and must come back ready (caught up);
then the active is updated, by a controlled switchover to the updated passive
(`method: Switchover`, the existing promote path of `failover.decide`: the active is
demoted first, the target activated only once the source reports passive) or by
recreating the active's pod (`RestartInPlace`: the updated passive takes over by
automatic failover). The old active comes back passive, is updated, and the rollout
is complete once it is ready again.

Everything `plan` needs is observed (which pod runs which revision, who is active,
who is ready) or kept in `status.rollout` (the step and since when), so an operator
restarted mid-rollout resumes where it stopped. An updated broker that crashes or is
not ready within the timeout stops the rollout (`Stalled`); the active is only ever
touched once the other broker is updated and ready, so it stays active and serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from twinmq.operator.failover import OTHER, BrokerView, Event
from twinmq.operator.models import BrokerName, RolloutStep

NAMES: tuple[BrokerName, ...] = ("primary", "backup")
CANNOT_START = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})  # fmt: skip
"""Container waiting reasons that mean the container will not start by itself."""
CRASH_LOOP_RESTARTS = 3
"""Restarts of a new broker container that make a crash loop. Not 1: a passive exits (75)
and is restarted to re-sync after some replication failures, and that is no crash."""


@dataclass(frozen=True)
class PodView:
    """One broker's pod as read just now."""

    present: bool
    current: bool = False  # created from the desired template (its hash annotation)
    terminating: bool = False
    failing: str | None = None  # why its broker container cannot run (see `pod_failure`)

    @property
    def outdated(self) -> bool:
        """A pod that runs another template and must be recreated."""
        return self.present and not self.current


@dataclass(frozen=True)
class Progress:
    """`status.rollout` as `plan` reads and writes it (`since` in seconds since the epoch)."""

    revision: str
    step: RolloutStep
    broker: BrokerName | None
    since: float
    message: str = ""


@dataclass(frozen=True)
class RolloutObservation:
    """Everything `plan` may look at."""

    revision: str  # names the desired templates of both pods (status, Events)
    pods: dict[BrokerName, PodView]
    brokers: dict[BrokerName, BrokerView]
    active: BrokerName | None
    epoch: int
    busy: str | None  # a switchover, failover or manual request is moving roles: why
    fenced: frozenset[BrokerName]
    method: Literal["Switchover", "RestartInPlace"]
    supervised: bool
    ready_timeout: float
    progress: Progress | None
    now: float


@dataclass(frozen=True)
class DeletePod:
    """Delete a broker's pod; the reconciler recreates it from the desired template."""

    broker: BrokerName


@dataclass(frozen=True)
class RequestSwitchover:
    """Move the active role to `target` by the promote path of `failover.decide`."""

    target: BrokerName


@dataclass
class RolloutDecision:
    """What to do now, and the progress to record (None: no rollout ever happened)."""

    progress: Progress | None
    actions: list[DeletePod | RequestSwitchover] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    converged: bool = False  # both pods run the desired template and are back in service


def pod_failure(pod: dict[str, Any] | None) -> str | None:
    """Why the broker container of `pod` cannot run, or None (running, or starting)."""
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    broker = next((s for s in statuses if s.get("name") == "broker"), None)
    if broker is None:
        return None
    waiting = (broker.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in CANNOT_START:
        return f"{waiting['reason']}: {waiting.get('message') or 'no message'}"[:300]
    if int(broker.get("restartCount") or 0) >= CRASH_LOOP_RESTARTS:
        # A pod is new at every update: its restarts are all of the new template.
        last = (broker.get("lastState") or {}).get("terminated") or {}
        return (
            f"the broker container restarted {broker['restartCount']} time(s); "
            f"last exit code {last.get('exitCode', '?')} ({last.get('reason') or 'Error'})"
        )
    return None


def _serving(view: BrokerView, epoch: int) -> bool:
    return view.reachable and view.role == "active" and view.epoch >= epoch


def _back(view: BrokerView) -> bool:
    return view.reachable and view.role == "passive" and view.ready


def plan(obs: RolloutObservation) -> RolloutDecision:
    """The next step of the rollout of `obs.revision`."""
    current = obs.progress
    if current is not None and current.revision != obs.revision:
        current = None  # superseded: a newer template replaces the one being rolled out
    if not any(obs.pods[n].outdated for n in NAMES) and (
        current is None or current.step == "Complete"
    ):
        # Nothing to update (created at this revision, or done): keep the last record.
        return RolloutDecision(obs.progress, converged=_all_present(obs))
    if obs.epoch == 0 or obs.active is None:
        return _hold(obs, "UpdatingPassive", None, "waiting for an active broker")
    active, passive = obs.active, OTHER[obs.active]
    if not _serving(obs.brokers[active], obs.epoch):
        return _hold(obs, "UpdatingPassive", active,
                     f"waiting for {active} to serve as the active")  # fmt: skip
    if obs.busy is not None:
        return _hold(obs, "UpdatingPassive", None, obs.busy)
    if obs.fenced:
        names = ", ".join(sorted(obs.fenced))
        return _stall(obs, None, f"{names} fenced: unfence to let the rollout go on")
    # 1. The passive first.
    pod = obs.pods[passive]
    if not pod.current:
        if not pod.present or pod.terminating:
            return _at(obs, "UpdatingPassive", passive, f"recreating {passive}'s pod")
        return _at(
            obs, "UpdatingPassive", passive, f"recreating {passive}'s pod (the passive)",
            DeletePod(passive),
        )  # fmt: skip
    if not _back(obs.brokers[passive]):
        return _wait_ready(obs, "UpdatingPassive", passive)
    # 2. Then the active, once the updated passive holds every confirmed message.
    if obs.pods[active].current:
        return _complete(obs)
    if obs.method == "RestartInPlace":
        if obs.pods[active].terminating:
            return _at(obs, "RestartingActive", active, f"{active}'s pod is terminating")
        return _at(
            obs, "RestartingActive", active,
            f"recreating the active {active}'s pod; {passive} takes over by failover",
            DeletePod(active),
        )  # fmt: skip
    if obs.supervised:
        return _at(
            obs, "WaitingForSwitchover", passive,
            f"{passive} is updated and ready: promote it (kubectl twinmq promote "
            f"<cluster> {passive}) to update {active}",
        )  # fmt: skip
    return _at(
        obs, "SwitchingOver", passive, f"switching over to the updated {passive}",
        RequestSwitchover(passive),
    )  # fmt: skip


def _all_present(obs: RolloutObservation) -> bool:
    return all(obs.pods[n].current and not obs.pods[n].terminating for n in NAMES)


def _at(
    obs: RolloutObservation,
    step: RolloutStep,
    broker: BrokerName | None,
    message: str,
    *actions: DeletePod | RequestSwitchover,
) -> RolloutDecision:
    """Be at `step` on `broker` (since now, unless that is where the rollout already is)."""
    current = obs.progress
    same = (
        current is not None
        and current.revision == obs.revision
        and current.step == step
        and current.broker == broker
    )
    since = current.since if same and current is not None else obs.now
    events = [] if same else [Event("RollingUpdate", f"revision {obs.revision}: {message}")]
    return RolloutDecision(
        Progress(obs.revision, step, broker, since, message), list(actions), events
    )


def _hold(
    obs: RolloutObservation, step: RolloutStep, broker: BrokerName | None, why: str
) -> RolloutDecision:
    """Nothing to do until `why` is over; the step (and its start) are kept."""
    current = obs.progress
    if current is not None and current.revision == obs.revision and current.step != "Complete":
        step, broker, since = current.step, current.broker, current.since
    else:
        since = obs.now
    return RolloutDecision(Progress(obs.revision, step, broker, since, why))


def _stall(obs: RolloutObservation, broker: BrokerName | None, why: str) -> RolloutDecision:
    current = obs.progress
    if current is not None and current.revision == obs.revision and current.step == "Stalled":
        return RolloutDecision(Progress(obs.revision, "Stalled", broker, current.since, why))
    return RolloutDecision(
        Progress(obs.revision, "Stalled", broker, obs.now, why),
        events=[Event("RolloutStalled", f"revision {obs.revision}: {why}", warning=True)],
    )


def _wait_ready(obs: RolloutObservation, step: RolloutStep, broker: BrokerName) -> RolloutDecision:
    """Wait for an updated broker to come back ready; stall if it fails or takes too long."""
    failing = obs.pods[broker].failing
    if failing is not None:
        return _stall(obs, broker, f"updated {broker} is failing: {failing}")
    current = obs.progress
    started = (
        current.since
        if current is not None and current.revision == obs.revision and current.broker == broker
        and current.step in (step, "Stalled")
        else obs.now
    )  # fmt: skip
    if obs.now - started > obs.ready_timeout:
        return _stall(
            obs, broker,
            f"updated {broker} not ready (caught up) after {obs.ready_timeout:.0f}s",
        )  # fmt: skip
    decision = _at(obs, step, broker, f"waiting for the updated {broker} to catch up")
    if decision.progress is not None and current is not None and current.step == "Stalled":
        # Back from a stall (the broker recovered): the step starts over.
        decision.progress = Progress(obs.revision, step, broker, obs.now, decision.progress.message)
    return decision


def _complete(obs: RolloutObservation) -> RolloutDecision:
    decision = _at(obs, "Complete", obs.active, f"both brokers run it; {obs.active} is active")
    decision.converged = _all_present(obs)
    return decision
