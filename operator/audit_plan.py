"""When an audit run starts, and what a finished run says (pure: no I/O, no clock).

The reconciler observes (the spec's `audit`, the last run and its phase, the
last failover, whether the pair is in sync, an unhandled request) and
`plan_audit` decides; `audit_runner` applies. One run at a time per cluster:
a trigger that comes while a run is going waits for it (its state is in the
status, so it survives an operator restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from croniter import croniter

from twinmq.audit.summary import AuditSummary, CrossSiteSummary
from twinmq.operator.models import (
    Audit,
    AuditProgress,
    AuditResult,
    AuditScope,
    AuditVerdict,
    Condition,
    FailoverRecord,
    iso,
    parse_iso,
)

RunPhase = Literal["running", "succeeded", "failed", "missing"]
"""A run's Job or SparkApplication: still going, ended (its exit code is in the
summary's verdict), or gone before it ended."""

TERMINAL_SPARK_STATES = {
    "COMPLETED": "succeeded",
    "FAILED": "failed",
    "SUBMISSION_FAILED": "failed",
}
"""SparkApplication `status.applicationState.state` values after which the operator
(Spark Operator) never runs the application again (restartPolicy Never)."""


@dataclass(frozen=True)
class AuditObservation:
    """What the audit planner needs to know (all of it read by the reconciler)."""

    audit: Audit
    now: datetime
    created: datetime
    """The BrokerCluster's creation: the base of the first scheduled run."""
    progress: AuditProgress
    last: AuditResult | None
    run_phase: RunPhase | None
    """Phase of `last.run` when `last` is RUNNING."""
    last_failover: FailoverRecord | None
    in_sync_since: datetime | None
    """Since when the passive has held every confirmed message (None: it does not)."""
    request: str | None
    """An audit request id not handled yet."""
    request_sites: bool = False
    """That request asks for a cross-site run."""
    mirror_epoch: int | None = None
    """The DR epoch the active broker reports (None: no mirror, or no answer)."""


@dataclass(frozen=True)
class AuditPlan:
    """What to do now."""

    launch: str | None = None
    """Start a run, for these reasons (`schedule`, `failover to backup in epoch 3`, ...)."""
    scope: AuditScope = "pair"
    """What the run compares: the pair's two brokers, or this DR site with the other."""
    finish: RunPhase | None = None
    """The running run ended (or vanished): read its summary, record the verdict."""
    timed_out: bool = False
    """The running run exceeded timeoutSeconds: stop it, record ERROR."""
    handled_request: str | None = None
    refused_request: bool = False
    """The request came while audits are disabled: warn, mark it handled."""
    progress: AuditProgress = field(default_factory=AuditProgress)


def failover_settle_seconds(audit: Audit) -> float:
    """How long the pair must have been in sync after a failover before its audit: the
    brokers close a segment every `segmentSeconds` and the shippers look as often, so two
    periods see both brokers' segments around the failover in the store."""
    return 2.0 * audit.segment_seconds + 2.0


def plan_audit(obs: AuditObservation) -> AuditPlan:
    """Decide: finish or time out the running run, else start one if a trigger is due."""
    audit, last = obs.audit, obs.last
    progress = obs.progress.model_copy()
    if last is not None and last.verdict == "RUNNING":
        if obs.run_phase in ("succeeded", "failed", "missing"):
            return AuditPlan(finish=obs.run_phase, progress=progress)
        started = parse_iso(last.time)
        if obs.now - started > timedelta(seconds=audit.timeout_seconds):
            return AuditPlan(timed_out=True, progress=progress)
        return AuditPlan(progress=progress)  # a trigger now waits for this run
    if not audit.enabled:
        if obs.request is not None:
            return AuditPlan(handled_request=obs.request, refused_request=True, progress=progress)
        return AuditPlan(progress=progress)
    if obs.request is not None and obs.request_sites:
        if audit.mirror_store_url is None:
            return AuditPlan(handled_request=obs.request, refused_request=True, progress=progress)
        return AuditPlan(
            launch="requested", scope="sites", handled_request=obs.request, progress=progress
        )
    if (switch := _dr_switch_due(obs, progress)) is not None:
        # One run at a time: a pair trigger due now waits for the next reconcile after it.
        return AuditPlan(launch=switch, scope="sites", progress=progress)
    reasons: list[str] = []
    if obs.request is not None:
        reasons.append("requested")
    failover = obs.last_failover
    if (
        audit.after_failover
        and failover is not None
        and failover.epoch > progress.audited_epoch
        and obs.in_sync_since is not None
        and obs.in_sync_since >= parse_iso(failover.time)
        and obs.now - obs.in_sync_since >= timedelta(seconds=failover_settle_seconds(audit))
    ):
        reasons.append(f"failover to {failover.to_broker} in epoch {failover.epoch}")
        progress.audited_epoch = failover.epoch
    if audit.schedule:
        base = parse_iso(progress.last_scheduled) if progress.last_scheduled else obs.created
        due: datetime = croniter(audit.schedule, base).get_next(datetime)
        if due <= obs.now:
            # Missed times are not caught up one by one: one run covers them (the audit is
            # incremental), and the next one is due at the next time after now.
            latest: datetime = croniter(audit.schedule, obs.now).get_prev(datetime)
            progress.last_scheduled = iso(latest)
            reasons.append("schedule")
    if not reasons:
        return AuditPlan(progress=progress)
    return AuditPlan(launch=", ".join(reasons), handled_request=obs.request, progress=progress)


def _dr_switch_due(obs: AuditObservation, progress: AuditProgress) -> str | None:
    """The reason for a cross-site run after a DR switch, once it is due (else None).

    A new DR epoch means a switchover or failover this site took part in (epoch 0: never
    switched). The run waits as a failover's does (`failover_settle_seconds`) from when the
    operator first saw the epoch, so both sites' brokers have closed and shipped the
    segments around the switch; the time is kept in the status (an operator restart
    neither restarts nor skips the wait).
    """
    audit, epoch = obs.audit, obs.mirror_epoch
    if epoch is None:
        return None  # no answer from the active now: neither start nor restart the wait
    if (
        audit.mirror_store_url is None
        or not audit.after_mirror_switch
        or epoch <= progress.audited_dr_epoch
    ):
        progress.dr_epoch_seen = None
        return None
    if progress.dr_epoch_seen is None:
        progress.dr_epoch_seen = iso(obs.now)
        return None
    if obs.now - parse_iso(progress.dr_epoch_seen) < timedelta(
        seconds=failover_settle_seconds(audit)
    ):
        return None
    progress.audited_dr_epoch = epoch
    progress.dr_epoch_seen = None
    return f"DR switch to epoch {epoch}"


def result_of_summary(
    running: AuditResult, summary: AuditSummary | CrossSiteSummary, finished: datetime
) -> AuditResult:
    """A finished run's result from the summary it wrote to the store (a pair's, or a
    cross-site one: `twinmq audit --mirror-store`)."""
    if isinstance(summary, CrossSiteSummary):
        cross = summary.totals
        counts = {"messages": cross.messages, "lost": cross.lost,
                  "duplicates": cross.duplicated}  # fmt: skip
        clean = (f"{cross.messages} messages across sites, {cross.mirrored} mirrored, "
                 f"{cross.in_flight} in flight, none lost or duplicated")  # fmt: skip
    else:
        pair = summary.totals
        counts = {"messages": pair.messages, "lost": pair.lost, "reordered": pair.reordered,
                  "duplicates": pair.resent + pair.replicated_twice}  # fmt: skip
        clean = f"{pair.messages} messages audited, none lost, duplicated twice or reordered"
    verdict: AuditVerdict = "PASS" if summary.verdict.value == "PASS" else "FAIL"
    message = "; ".join(summary.failures) if summary.failures else clean
    return running.model_copy(
        update={"verdict": verdict, "finished": iso(finished), "message": message, **counts}
    )


def result_error(running: AuditResult, message: str, finished: datetime) -> AuditResult:
    """A run that ended without a verdict (crashed, stopped, deleted, never submitted)."""
    return running.model_copy(
        update={"verdict": "ERROR", "finished": iso(finished), "message": message}
    )


def audit_condition(result: AuditResult, previous: Condition | None, generation: int) -> Condition:
    """`AuditPassed` from a finished run: True on PASS, False on FAIL, Unknown on ERROR."""
    status: Literal["True", "False", "Unknown"] = {"PASS": "True", "FAIL": "False"}.get(
        result.verdict, "Unknown"
    )  # type: ignore[assignment]
    reason = {"True": "AuditPassed", "False": "AuditFailed"}.get(status, "AuditError")
    since = (
        previous.last_transition_time
        if previous is not None and previous.status == status
        else result.finished
    )
    return Condition(
        type="AuditPassed",
        status=status,
        reason=reason,
        message=f"run {result.run}: {result.message}",
        last_transition_time=since,
        observed_generation=generation,
    )


def job_phase(job: dict[str, object] | None) -> RunPhase:
    """A batch/v1 Job's phase (`Complete` / `Failed` conditions, or still running)."""
    if job is None:
        return "missing"
    status = job.get("status") or {}
    assert isinstance(status, dict)
    for cond in status.get("conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "succeeded"
        if cond.get("status") == "True" and cond.get("type") in ("Failed", "FailureTarget"):
            return "failed"
    return "running"


def spark_phase(app: dict[str, object] | None) -> RunPhase:
    """A SparkApplication's phase from `status.applicationState.state`."""
    if app is None:
        return "missing"
    status = app.get("status") or {}
    assert isinstance(status, dict)
    state = str((status.get("applicationState") or {}).get("state") or "")
    phase = TERMINAL_SPARK_STATES.get(state, "running")
    return phase  # type: ignore[return-value]


def unschedulable(pods: list[dict[str, object]]) -> str | None:
    """Why a run's pod waits for a node (the scheduler's message), or None: a run stuck
    there would otherwise look like a slow audit until `timeoutSeconds`."""
    for pod in pods:
        status = pod.get("status") or {}
        assert isinstance(status, dict)
        if status.get("phase") != "Pending":
            continue
        for cond in status.get("conditions") or []:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
                "PodScheduled", "False", "Unschedulable",
            ):  # fmt: skip
                return str(cond.get("message") or "no node fits the pod")
    return None
