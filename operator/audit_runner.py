"""Audit runs applied: launch, track, read the verdict from the store, clean up.

Called by the reconciler after the failover decisions; `audit_plan.plan_audit`
decides, this module does the Kubernetes and store I/O and records the outcome
in the status (`lastAudit`, `audit`, the `AuditPassed` condition), with an
Event and a metric per run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from twinmq.audit.store import Store
from twinmq.audit.summary import AuditSummary, CrossSiteSummary
from twinmq.operator import audit_builders, metrics
from twinmq.operator.audit_plan import (
    AuditObservation,
    RunPhase,
    audit_condition,
    job_phase,
    plan_audit,
    result_error,
    result_of_summary,
    spark_phase,
    unschedulable,
)
from twinmq.operator.builders import LABEL_CLUSTER, ClusterRef, Obj
from twinmq.operator.kube import Kube
from twinmq.operator.models import (
    AuditResult,
    AuditScope,
    BrokerClusterSpec,
    BrokerClusterStatus,
    iso,
    parse_iso,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launcher:
    """How one launcher's runs are built and read."""

    api_version: str
    kind: str
    build: Callable[[ClusterRef, BrokerClusterSpec, str, str, AuditScope], Obj]
    phase: Callable[[Obj | None], RunPhase]


LAUNCHERS = {
    "job": Launcher("batch/v1", "Job", audit_builders.build_audit_job, job_phase),
    "sparkApplication": Launcher(
        audit_builders.SPARK_API,
        "SparkApplication",
        audit_builders.build_spark_application,
        spark_phase,
    ),
}


def store_options(credentials: dict[str, str]) -> dict[str, Any]:
    """s3fs options from the store Secret's environment variables (the pods get them as
    their environment; the operator, serving many clusters, passes them explicitly)."""
    options: dict[str, Any] = {}
    client: dict[str, str] = {}
    if "AWS_ACCESS_KEY_ID" in credentials:
        options["key"] = credentials["AWS_ACCESS_KEY_ID"]
        options["secret"] = credentials.get("AWS_SECRET_ACCESS_KEY", "")
    if "AWS_SESSION_TOKEN" in credentials:
        options["token"] = credentials["AWS_SESSION_TOKEN"]
    if "AWS_ENDPOINT_URL" in credentials:
        client["endpoint_url"] = credentials["AWS_ENDPOINT_URL"]
    region = credentials.get("AWS_REGION") or credentials.get("AWS_DEFAULT_REGION")
    if region:
        client["region_name"] = region
    if client:
        options["client_kwargs"] = client
    return options


def read_summary(
    kube: Kube, namespace: str, spec: BrokerClusterSpec, run: str, scope: AuditScope
) -> AuditSummary | CrossSiteSummary | None:
    """The run's summary from the store (None: the run wrote none). Raises OSError when the
    store cannot be reached (the next reconcile tries again)."""
    assert spec.audit.store_url is not None
    secret = spec.audit.store_secret_name
    credentials = kube.get_secret_data(namespace, secret) if secret else {}
    if credentials is None:
        raise OSError(f'secrets "{secret}" not found')
    store = Store(spec.audit.store_url, store_options(credentials))
    if scope == "sites":
        raw = store.read_json(f"audit/cross/{run}/summary.json")
        return None if raw is None else CrossSiteSummary.model_validate(raw)
    raw = store.read_json(f"audit/runs/{run}/summary.json")
    return None if raw is None else AuditSummary.model_validate(raw)


def _failure_detail(obj: Obj | None, launcher: Launcher, run: str) -> str:
    if obj is None:
        return f"the {launcher.kind} {run} was deleted before it finished"
    state = (obj.get("status") or {}).get("applicationState") or {}
    if state.get("errorMessage"):
        return f"{state.get('state')}: {state['errorMessage']}"
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return f"{cond.get('reason')}: {cond.get('message', '')}"
    return f"the {launcher.kind} {run} ended without writing a summary (see its logs)"


class AuditRunner:
    """One reconcile's audit work for one cluster (status changes go into `new`)."""

    def __init__(
        self,
        kube: Kube,
        cluster: ClusterRef,
        spec: BrokerClusterSpec,
        new: BrokerClusterStatus,
        body: Any,
        generation: int,
    ) -> None:
        self.kube, self.cluster, self.spec, self.new = kube, cluster, spec, new
        self.body, self.generation = body, generation

    def reconcile_guarded(
        self, created: datetime, now: datetime, last_error: str | None
    ) -> str | None:
        """`reconcile`, but an audit problem (a missing Secret, a store that refuses the
        credentials, an API the operator may not use) never holds up the failover work
        of the same reconcile: it is logged and posted as a Warning when it first appears
        (not every second), and returned, so the caller can tell when it changes."""
        try:
            self.reconcile(created, now)
        except Exception as exc:  # any failure here must stay here
            error = f"{type(exc).__name__}: {exc}"[:500]
            if error != last_error:
                log.exception("%s/%s: audit work failed", self.cluster.namespace,
                              self.cluster.name)  # fmt: skip
                self._event("AuditProblem", f"audit work failed (retried every reconcile): "
                            f"{error}", warning=True)  # fmt: skip
            return error
        return None

    def reconcile(self, created: datetime, now: datetime) -> None:
        """Observe, plan, apply."""
        new, spec = self.new, self.spec
        last = new.last_audit
        run_obj: Obj | None = None
        phase: RunPhase | None = None
        if last is not None and last.verdict == "RUNNING":
            run_obj = self._get_run(last)
            phase = LAUNCHERS[last.launcher].phase(run_obj)
        replicating = next((c for c in new.conditions if c.type == "Replicating"), None)
        in_sync_since = (
            parse_iso(replicating.last_transition_time)
            if replicating is not None
            and replicating.status == "True"
            and replicating.last_transition_time
            else None
        )
        request = spec.requests.audit
        mirror = new.mirror
        plan = plan_audit(
            AuditObservation(
                audit=spec.audit,
                now=now,
                created=created,
                progress=new.audit,
                last=last,
                run_phase=phase,
                last_failover=new.last_failover,
                in_sync_since=in_sync_since,
                request=request.id
                if request is not None and request.id != new.handled_requests.audit
                else None,
                request_sites=request is not None and request.sites,
                mirror_epoch=mirror.epoch
                if mirror is not None and mirror.state != "Unknown"
                else None,
            )
        )
        new.audit = plan.progress
        if plan.handled_request is not None:
            new.handled_requests.audit = plan.handled_request
        if plan.refused_request:
            why = ("spec.audit.enabled is false" if not spec.audit.enabled
                   else "a cross-site audit needs spec.audit.mirrorStoreUrl")  # fmt: skip
            self._event("AuditNotEnabled", f"audit request {plan.handled_request}: "
                        f"{why}, nothing ran", warning=True)  # fmt: skip
        if last is not None and (plan.finish is not None or plan.timed_out):
            self._finish(last, plan.finish, run_obj, now)
        elif last is not None and last.verdict == "RUNNING":
            self._watch_pending(last)
        if plan.launch is not None:
            self._launch(plan.launch, plan.scope, now)

    # -- the steps ---------------------------------------------------------------------------

    def _get_run(self, last: AuditResult) -> Obj | None:
        launcher = LAUNCHERS[last.launcher]
        try:
            return self.kube.get(
                launcher.api_version, launcher.kind, self.cluster.namespace, last.run
            )
        except ResourceNotFoundError:  # the SparkApplication CRD went away
            return None

    def _runs(self, launcher: Launcher) -> list[Obj]:
        """This cluster's runs of one launcher, newest first ([] without its API)."""
        selector = f"{LABEL_CLUSTER}={self.cluster.name},{audit_builders.LABEL_RUN}"
        try:
            runs = self.kube.list(
                launcher.api_version, launcher.kind, self.cluster.namespace, selector
            )
        except ResourceNotFoundError:
            return []
        return sorted(runs, key=lambda r: str(r["metadata"]["name"]), reverse=True)  # by time

    def _launch(self, reason: str, scope: AuditScope, now: datetime) -> None:
        spec, cluster = self.spec, self.cluster
        launcher = LAUNCHERS[spec.audit.launcher]
        # A run created by an operator that died before recording it is adopted, never
        # doubled: two runs must not write one store at once.
        orphan = next((r for r in self._runs(launcher) if launcher.phase(r) == "running"), None)
        if orphan is not None:
            meta = orphan["metadata"]
            notes = meta.get("annotations") or {}
            self.new.last_audit = AuditResult(
                time=meta.get("creationTimestamp") or iso(now), verdict="RUNNING",
                run=meta["name"], launcher=spec.audit.launcher,
                reason=notes.get(audit_builders.ANNOTATION_REASON, ""),
                scope="sites" if notes.get(audit_builders.ANNOTATION_SCOPE) == "sites"
                else "pair",
            )  # fmt: skip
            log.info("%s/%s: following the unrecorded run %s", cluster.namespace,
                     cluster.name, meta["name"])  # fmt: skip
            return
        name = audit_builders.run_name(cluster, now)
        running = AuditResult(
            time=iso(now), verdict="RUNNING", run=name, reason=reason,
            launcher=spec.audit.launcher, scope=scope,
        )  # fmt: skip
        try:
            self.kube.ensure(launcher.build(cluster, spec, name, reason, scope))
        except ResourceNotFoundError:
            message = (
                "the SparkApplication API (sparkoperator.k8s.io/v1beta2) is not installed: "
                "install the Kubeflow Spark Operator, or set spec.audit.launcher to job"
            )
            self._record(result_error(running, message, now))
            return
        except ApiException as exc:
            self._record(result_error(running, f"cannot create the {launcher.kind}: "
                                      f"{exc.status} {exc.reason}: {exc.body}", now))  # fmt: skip
            return
        self.new.last_audit = running
        metrics.AUDITS_STARTED.inc()
        what = "cross-site audit" if scope == "sites" else "audit"
        self._event("AuditStarted", f"{what} run {name} started ({reason}) as a {launcher.kind}")

    def _watch_pending(self, last: AuditResult) -> None:
        """A running run whose pod no node takes says so in `lastAudit.message`, with a
        Warning Event when the scheduler's reason first appears or changes."""
        selector = f"{audit_builders.LABEL_RUN}={last.run}"
        waiting = unschedulable(self.kube.list("v1", "Pod", self.cluster.namespace, selector))
        message = f"waiting for a node: {waiting}" if waiting else ""
        if message == last.message:
            return
        self.new.last_audit = last.model_copy(update={"message": message})
        if waiting:
            self._event("AuditPending", f"audit run {last.run}: {message}", warning=True)

    def _finish(
        self, last: AuditResult, phase: RunPhase | None, run_obj: Obj | None, now: datetime
    ) -> None:
        launcher = LAUNCHERS[last.launcher]
        if phase is None:  # timed out
            self.kube.delete(launcher.api_version, launcher.kind, self.cluster.namespace, last.run)
            message = f"stopped after {self.spec.audit.timeout_seconds}s (timeoutSeconds)"
            self._record(result_error(last, message, now))
            return
        try:
            summary = read_summary(
                self.kube, self.cluster.namespace, self.spec, last.run, last.scope
            )
        except (OSError, ValueError) as exc:
            log.warning("%s/%s: cannot read the summary of %s yet: %s",
                        self.cluster.namespace, self.cluster.name, last.run, exc)  # fmt: skip
            return
        if summary is None:
            self._record(result_error(last, _failure_detail(run_obj, launcher, last.run), now))
        else:
            self._record(result_of_summary(last, summary, now))

    def _record(self, result: AuditResult) -> None:
        new = self.new
        new.last_audit = result
        previous = next((c for c in new.conditions if c.type == "AuditPassed"), None)
        condition = audit_condition(result, previous, self.generation)
        new.conditions = [c for c in new.conditions if c.type != "AuditPassed"] + [condition]
        metrics.AUDITS.labels(result.verdict, self.cluster.namespace, self.cluster.name).inc()
        text = f"audit run {result.run} ({result.reason}): {result.verdict}: {result.message}"
        log.info("%s/%s: %s", self.cluster.namespace, self.cluster.name, text)
        self._event(condition.reason, text, warning=result.verdict != "PASS")
        self._clean_up(keep=result.run)

    def _clean_up(self, keep: str) -> None:
        """Delete finished runs beyond the history limit (oldest first)."""
        launcher = LAUNCHERS[self.spec.audit.launcher]
        finished = [
            r for r in self._runs(launcher)
            if r["metadata"]["name"] == keep or launcher.phase(r) != "running"
        ]  # fmt: skip
        for old in finished[self.spec.audit.history_limit :]:
            self.kube.delete(
                launcher.api_version, launcher.kind, self.cluster.namespace,
                old["metadata"]["name"],
            )  # fmt: skip

    def _event(self, reason: str, message: str, warning: bool = False) -> None:
        kopf.event(self.body, type="Warning" if warning else "Normal", reason=reason,
                   message=message)  # fmt: skip
