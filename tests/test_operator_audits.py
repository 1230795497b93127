"""The operator's audits without a cluster: when runs start, what a run's end means, and
the Job / SparkApplication / shipper objects it creates (validated against Kubernetes'
schemas; the SparkApplication against the Spark Operator's CRD in e2e/test_audit_operator)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from typing import Any

import pytest

from twinmq.audit.summary import (
    AuditSummary,
    Counts,
    CrossSiteCounts,
    CrossSiteSummary,
    SiteInfo,
    Verdict,
)
from twinmq.operator.audit_builders import (
    ANNOTATION_SCOPE,
    LABEL_RUN,
    build_audit_job,
    build_spark_application,
    memory_quantity,
    run_name,
)
from twinmq.operator.audit_plan import (
    AuditObservation,
    audit_condition,
    failover_settle_seconds,
    job_phase,
    plan_audit,
    result_error,
    result_of_summary,
    spark_phase,
)
from twinmq.operator.audit_runner import store_options
from twinmq.operator.builders import ClusterRef, build_pod
from twinmq.operator.models import (
    Audit,
    AuditProgress,
    AuditRequest,
    AuditResult,
    BrokerClusterSpec,
    BrokerClusterStatus,
    FailoverRecord,
    Requests,
    iso,
)

T0 = datetime(2026, 11, 22, 10, 0, 30, tzinfo=UTC)
CLUSTER = ClusterRef("orders", "shop", "uid-1")
STORE = "s3://audits/orders"


def enabled(**fields: Any) -> Audit:
    return Audit.model_validate({"enabled": True, "storeUrl": STORE, **fields})


def observe(audit: Audit, now: datetime = T0, **fields: Any) -> AuditObservation:
    base = AuditObservation(
        audit=audit, now=now, created=T0, progress=AuditProgress(), last=None,
        run_phase=None, last_failover=None, in_sync_since=None, request=None,
    )  # fmt: skip
    return replace(base, **fields)


def running(started: datetime = T0) -> AuditResult:
    return AuditResult(time=iso(started), verdict="RUNNING", run="orders-audit-1", reason="x")


def failover(epoch: int, at: datetime) -> FailoverRecord:
    return FailoverRecord.model_validate(
        {"time": iso(at), "from": "primary", "to": "backup", "reason": "lease lapsed",
         "epoch": epoch}
    )  # fmt: skip


# -- when runs start -------------------------------------------------------------------------


def test_a_request_on_a_cluster_without_audits_is_refused_once() -> None:
    plan = plan_audit(observe(Audit(), request="r1"))
    assert plan.refused_request and plan.handled_request == "r1" and plan.launch is None


def test_a_request_starts_a_run_and_is_handled_once() -> None:
    plan = plan_audit(observe(enabled(), request="r1"))
    assert plan.launch == "requested" and plan.handled_request == "r1"
    assert plan_audit(observe(enabled())).launch is None


def test_a_failover_is_audited_once_both_brokers_are_in_sync_and_settled() -> None:
    audit = enabled(segmentSeconds=5)
    record = failover(3, T0)
    settle = timedelta(seconds=failover_settle_seconds(audit))
    synced = T0 + timedelta(seconds=20)
    not_yet = [
        observe(audit, T0 + timedelta(seconds=30), last_failover=record),  # never in sync
        observe(audit, synced + settle / 2, last_failover=record, in_sync_since=synced),
        # in sync since before the failover: the old pair, not the new one
        observe(audit, T0 + settle * 3, last_failover=record, in_sync_since=T0 - settle),
    ]
    for obs in not_yet:
        assert plan_audit(obs).launch is None
    plan = plan_audit(observe(audit, synced + settle, last_failover=record, in_sync_since=synced))
    assert plan.launch == "failover to backup in epoch 3"
    assert plan.progress.audited_epoch == 3
    again = observe(
        audit, synced + settle * 2, last_failover=record, in_sync_since=synced,
        progress=plan.progress,
    )  # fmt: skip
    assert plan_audit(again).launch is None


def test_no_failover_audit_when_after_failover_is_off() -> None:
    obs = observe(
        enabled(afterFailover=False), T0 + timedelta(hours=1), last_failover=failover(2, T0),
        in_sync_since=T0 + timedelta(seconds=1),
    )  # fmt: skip
    assert plan_audit(obs).launch is None


def test_a_trigger_during_a_run_waits_for_it_to_end() -> None:
    obs = observe(enabled(), last=running(), run_phase="running", request="r2")
    plan = plan_audit(obs)
    assert plan.launch is None and plan.handled_request is None and plan.finish is None


def test_the_schedule_starts_one_run_per_due_time_and_one_for_many_missed() -> None:
    audit = enabled(schedule="*/5 * * * *")
    assert plan_audit(observe(audit, T0 + timedelta(minutes=4))).launch is None
    plan = plan_audit(observe(audit, T0 + timedelta(minutes=4, seconds=40)))
    assert plan.launch == "schedule" and plan.progress.last_scheduled == "2026-11-22T10:05:00Z"
    later = observe(audit, T0 + timedelta(minutes=7), progress=plan.progress)
    assert plan_audit(later).launch is None
    # The operator was away for a day: one run, and the next one at the next time.
    away = plan_audit(observe(audit, T0 + timedelta(days=1, seconds=10), progress=plan.progress))
    assert away.launch == "schedule"
    assert away.progress.last_scheduled == "2026-11-23T10:00:00Z"


def test_reasons_combine_into_one_run() -> None:
    obs = observe(
        enabled(schedule="0 * * * *"), T0 + timedelta(hours=1), request="r3",
        last_failover=failover(4, T0), in_sync_since=T0 + timedelta(seconds=5),
    )  # fmt: skip
    assert plan_audit(obs).launch == "requested, failover to backup in epoch 4, schedule"


# -- a run's end -------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["succeeded", "failed", "missing"])
def test_an_ended_run_is_finished(phase: str) -> None:
    plan = plan_audit(observe(enabled(), last=running(), run_phase=phase))
    assert plan.finish == phase and plan.launch is None


def test_a_run_past_its_timeout_is_stopped() -> None:
    audit = enabled(timeoutSeconds=600)
    late = observe(audit, T0 + timedelta(seconds=601), last=running(), run_phase="running")
    assert plan_audit(late).timed_out
    on_time = observe(audit, T0 + timedelta(seconds=599), last=running(), run_phase="running")
    assert not plan_audit(on_time).timed_out


def test_job_and_spark_application_phases() -> None:
    def job(ctype: str) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": ctype, "status": "True"}]}}

    assert job_phase(None) == "missing"
    assert job_phase({"status": {"active": 1}}) == "running"
    assert job_phase(job("Complete")) == "succeeded"
    assert job_phase(job("Failed")) == "failed"

    def app(state: str) -> dict[str, Any]:
        return {"status": {"applicationState": {"state": state}}}

    assert spark_phase({}) == "running"  # not picked up by the Spark Operator yet
    for state in ("", "SUBMITTED", "RUNNING", "SUCCEEDING", "FAILING", "PENDING_RERUN",
                  "INVALIDATING", "UNKNOWN"):  # fmt: skip
        assert spark_phase(app(state)) == "running", state
    assert spark_phase(app("COMPLETED")) == "succeeded"
    assert spark_phase(app("FAILED")) == "failed"
    assert spark_phase(app("SUBMISSION_FAILED")) == "failed"
    assert spark_phase(None) == "missing"


MIRROR_STORE = "s3://audits/orders-site-b"


def test_a_dr_switch_is_audited_across_sites_once_both_sites_have_shipped() -> None:
    audit = enabled(mirrorStoreUrl=MIRROR_STORE, segmentSeconds=5)
    settle = timedelta(seconds=failover_settle_seconds(audit))
    # Epoch 0: the sites never switched; nothing to audit across them.
    assert plan_audit(observe(audit, mirror_epoch=0)).launch is None
    seen = plan_audit(observe(audit, mirror_epoch=1))
    assert seen.launch is None and seen.progress.dr_epoch_seen == iso(T0)
    # The wait is kept in the status: an operator restart neither restarts nor skips it.
    early = plan_audit(observe(audit, T0 + settle / 2, progress=seen.progress, mirror_epoch=1))
    assert early.launch is None and early.progress.dr_epoch_seen == iso(T0)
    # No answer from the active (epoch unknown) neither starts a run nor resets the wait.
    blind = plan_audit(observe(audit, T0 + settle, progress=seen.progress, mirror_epoch=None))
    assert blind.launch is None and blind.progress.dr_epoch_seen == iso(T0)
    due = plan_audit(observe(audit, T0 + settle, progress=seen.progress, mirror_epoch=1))
    assert (due.launch, due.scope) == ("DR switch to epoch 1", "sites")
    assert (due.progress.audited_dr_epoch, due.progress.dr_epoch_seen) == (1, None)
    later = T0 + 10 * settle
    assert plan_audit(observe(audit, later, progress=due.progress, mirror_epoch=1)).launch is None
    # The next switch (failback) is audited again.
    again = plan_audit(observe(audit, later, progress=due.progress, mirror_epoch=2))
    assert again.launch is None and again.progress.dr_epoch_seen == iso(later)


@pytest.mark.parametrize(
    "fields", [{}, {"mirrorStoreUrl": MIRROR_STORE, "afterMirrorSwitch": False}]
)
def test_no_cross_site_audit_without_a_mirror_store_or_when_switches_are_not_audited(
    fields: dict[str, Any],
) -> None:
    plan = plan_audit(observe(enabled(**fields), mirror_epoch=3))
    assert plan.launch is None and plan.progress.dr_epoch_seen is None


def test_a_cross_site_request_runs_across_sites_or_is_refused_without_a_mirror_store() -> None:
    asked = {"request": "r1", "request_sites": True}
    plan = plan_audit(observe(enabled(mirrorStoreUrl=MIRROR_STORE), **asked))
    assert (plan.launch, plan.scope, plan.handled_request) == ("requested", "sites", "r1")
    refused = plan_audit(observe(enabled(), **asked))
    assert refused.launch is None and refused.refused_request
    assert refused.handled_request == "r1"
    # A pair request is still the pair's audit.
    pair = plan_audit(observe(enabled(mirrorStoreUrl=MIRROR_STORE), request="r2"))
    assert (pair.launch, pair.scope) == ("requested", "pair")


def cross_summary(verdict: Verdict, failures: list[str], **counts: int) -> CrossSiteSummary:
    sites = [SiteInfo(name=n, store=u, brokers=[], segments=1, origins=[])
             for n, u in (("a", STORE), ("b", MIRROR_STORE))]  # fmt: skip
    return CrossSiteSummary(
        run_id="orders-audit-1", verdict=verdict, failures=failures, sites=sites,
        totals=CrossSiteCounts(**counts), queues=[],
    )  # fmt: skip


def test_a_cross_site_summary_becomes_the_result_and_the_condition() -> None:
    end = T0 + timedelta(minutes=1)
    passed = result_of_summary(
        running(), cross_summary(Verdict.PASS, [], messages=40, mirrored=38, in_flight=2), end
    )
    assert (passed.verdict, passed.messages, passed.lost, passed.duplicates) == ("PASS", 40, 0, 0)
    assert "38 mirrored, 2 in flight" in passed.message
    failed = result_of_summary(
        running(), cross_summary(Verdict.FAIL, ["2 lost"], messages=40, lost=2, duplicated=1),
        end,
    )  # fmt: skip
    assert (failed.verdict, failed.lost, failed.duplicates, failed.message) == (
        "FAIL", 2, 1, "2 lost",
    )  # fmt: skip
    assert audit_condition(failed, None, 1).reason == "AuditFailed"


def summary(verdict: Verdict, failures: list[str], **counts: int) -> AuditSummary:
    return AuditSummary(
        run_id="orders-audit-1", verdict=verdict, failures=failures, mode="full", store=STORE,
        brokers=["orders-primary", "orders-backup"], segments_read=4, segments_total=4,
        events_read=100, totals=Counts(**counts), queues=[], bucket_seconds=60.0,
        findings_path="f", lag_path="l",
    )  # fmt: skip


def test_a_summary_becomes_the_result_and_the_condition() -> None:
    end = T0 + timedelta(minutes=1)
    passed = result_of_summary(running(), summary(Verdict.PASS, [], messages=50, resent=2), end)
    assert (passed.verdict, passed.messages, passed.duplicates) == ("PASS", 50, 2)
    ok = audit_condition(passed, None, 1)
    assert (ok.status, ok.reason, ok.last_transition_time) == ("True", "AuditPassed", iso(end))
    failed = result_of_summary(
        running(), summary(Verdict.FAIL, ["3 confirmed messages lost"], messages=50, lost=3),
        end + timedelta(minutes=5),
    )  # fmt: skip
    assert (failed.verdict, failed.lost, failed.message) == ("FAIL", 3, "3 confirmed messages lost")
    bad = audit_condition(failed, ok, 1)
    assert (bad.status, bad.reason) == ("False", "AuditFailed")
    assert bad.last_transition_time == iso(end + timedelta(minutes=5))
    # A second failure keeps the time of the transition.
    assert audit_condition(failed, bad, 2).last_transition_time == bad.last_transition_time
    error = result_error(running(), "no summary", end)
    assert audit_condition(error, bad, 2).status == "Unknown"


# -- the objects -----------------------------------------------------------------------------


def spec_with(**audit: Any) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate(
        {"audit": {"enabled": True, "storeUrl": STORE, "storeSecretName": "s3", **audit}}
    )


def validate(obj: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, "1.36", strict=True)


def test_run_names_fit_the_pod_names_they_lead_to() -> None:
    long = ClusterRef("x" * 55, "ns", "u")
    assert len(run_name(long, T0) + "-driver") <= 63
    assert run_name(CLUSTER, T0) == "orders-audit-20261122100030"


def test_the_job_runs_the_audit_once_in_local_mode_on_the_store() -> None:
    spec = spec_with(resources={"driverCores": 2, "driverMemory": "3g"})
    job = build_audit_job(CLUSTER, spec, "orders-audit-1", "requested", "pair")
    validate(job)
    assert job["spec"]["backoffLimit"] == 0
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert job["metadata"]["labels"][LABEL_RUN] == "orders-audit-1"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    container = pod["containers"][0]
    assert container["command"] == ["twinmq-audit"]
    assert container["args"][:4] == ["--store", STORE, "--run-id", "orders-audit-1"]
    assert "--master=local[2]" in container["args"]
    assert "--conf=spark.driver.memory=3g" in container["args"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
    assert container["resources"]["limits"]["memory"] == memory_quantity("3g", 768) == "3840Mi"


def test_a_cross_site_run_names_both_sites_stores_and_says_so() -> None:
    spec = spec_with(mirrorStoreUrl=MIRROR_STORE)
    for build in (build_audit_job, build_spark_application):
        obj = build(CLUSTER, spec, "orders-audit-1", "DR switch to epoch 2", "sites")
        if obj["kind"] == "Job":
            validate(obj)
        body = obj["spec"]
        args = (body["template"]["spec"]["containers"][0]["args"] if obj["kind"] == "Job"
                else body["arguments"])  # fmt: skip
        assert args[:6] == [
            "--store", STORE, "--run-id", "orders-audit-1", "--mirror-store", MIRROR_STORE,
        ]  # fmt: skip
        assert obj["metadata"]["annotations"][ANNOTATION_SCOPE] == "sites"
    pair = build_audit_job(CLUSTER, spec, "orders-audit-1", "schedule", "pair")
    assert "--mirror-store" not in pair["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_spark_application_carries_the_same_program_and_resources() -> None:
    spec = spec_with(launcher="sparkApplication", image="spark/twinmq:1",
                     resources={"executorInstances": 3, "executorMemory": "2g"})  # fmt: skip
    app = build_spark_application(CLUSTER, spec, "orders-audit-1", "schedule", "pair")
    body = app["spec"]
    assert app["apiVersion"] == "sparkoperator.k8s.io/v1beta2"
    assert (body["type"], body["mode"], body["image"]) == ("Python", "cluster", "spark/twinmq:1")
    assert body["arguments"][:4] == ["--store", STORE, "--run-id", "orders-audit-1"]
    # Spark in local mode inside the driver pod (no s3a connector for executors).
    assert "--master=local[1]" in body["arguments"]
    assert body["sparkVersion"] == version("pyspark")  # the image's PySpark (image/*.lock)
    # Spark 4's driver NetworkPolicy, which the Spark Operator's chart may not create.
    excluded = body["sparkConf"]["spark.kubernetes.driver.pod.excludedFeatureSteps"]
    assert excluded.endswith(".NetworkPolicyFeatureStep")
    assert body["restartPolicy"] == {"type": "Never"}
    assert body["executor"]["instances"] == 3 and body["executor"]["memory"] == "2g"
    assert body["driver"]["serviceAccount"] == "spark-operator-spark"


def test_the_spark_driver_gets_its_command_and_store_credentials_from_its_pod_template() -> None:
    """Without the Spark Operator's webhook `envFrom` never reaches the pod, and the image
    has no Spark entrypoint for the `driver` argument: the pod template carries both."""
    spec = spec_with(launcher="sparkApplication")
    driver = build_spark_application(CLUSTER, spec, "orders-audit-1", "schedule", "pair")["spec"][
        "driver"
    ]
    assert "envFrom" not in driver
    template = driver["template"]
    validate({"apiVersion": "v1", "kind": "Pod", **template})
    container = template["spec"]["containers"][0]
    assert container["name"] == "spark-kubernetes-driver"
    assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
    command = container["command"]
    assert command[:2] == ["/usr/bin/tini", "--"] and "--deploy-mode client" in command[-2]


def test_brokers_write_and_ship_their_audit_log_only_when_audits_are_enabled() -> None:
    plain = build_pod(CLUSTER, BrokerClusterSpec(), "primary")
    assert [c["name"] for c in plain["spec"]["containers"]] == ["broker"]
    assert "--no-audit" in plain["spec"]["containers"][0]["args"]  # nothing would ship it
    pod = build_pod(CLUSTER, spec_with(segmentSeconds=7, keepShippedSeconds=60), "primary")
    validate(pod)
    broker, shipper = pod["spec"]["containers"][:2]
    assert "--audit-segment-seconds=7" in broker["args"] and "--no-audit" not in broker["args"]
    assert shipper["command"] == ["twinmq-audit-ship"]
    assert f"--store={STORE}" in shipper["args"] and "--every=7" in shipper["args"]
    assert "--keep-shipped=60" in shipper["args"]
    assert "--audit-dir=/var/lib/twinmq/data/audit" in shipper["args"]
    assert shipper["envFrom"] == [{"secretRef": {"name": "s3"}}]


def test_store_credentials_become_s3fs_options() -> None:
    options = store_options({
        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ENDPOINT_URL": "http://10.96.0.20:5000", "AWS_REGION": "eu-west-1",
    })  # fmt: skip
    assert options == {
        "key": "k", "secret": "s",
        "client_kwargs": {"endpoint_url": "http://10.96.0.20:5000", "region_name": "eu-west-1"},
    }  # fmt: skip
    assert store_options({}) == {}


# -- the runner against an in-memory API (the real one: e2e/test_audit_operator.py) ----------


class MemoryKube:
    """The calls `AuditRunner` makes, answered from a dict of objects."""

    def __init__(self, spark_api: bool = True) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.deleted: list[str] = []
        self.spark_api = spark_api

    def _check(self, kind: str) -> None:
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        if kind == "SparkApplication" and not self.spark_api:
            raise ResourceNotFoundError("no sparkoperator.k8s.io/v1beta2")

    def ensure(self, obj: dict[str, Any]) -> bool:
        self._check(obj["kind"])
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj
        return True

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        self._check(kind)
        return self.objects.get((kind, name))

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        self._check(kind)
        return [o for (k, _), o in self.objects.items() if k == kind]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, name), None)
        self.deleted.append(name)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """kopf's Events, recorded instead of posted."""
    posted: list[tuple[str, str]] = []
    monkeypatch.setattr(
        "twinmq.operator.audit_runner.kopf.event",
        lambda body, type, reason, message: posted.append((reason, message)),
    )
    return posted


def runner(kube: MemoryKube, spec: BrokerClusterSpec, status: Any) -> Any:
    from twinmq.operator.audit_runner import AuditRunner

    return AuditRunner(kube, CLUSTER, spec, status, body={}, generation=1)  # type: ignore[arg-type]


def requested(spec: BrokerClusterSpec, request: str) -> BrokerClusterSpec:
    return spec.model_copy(update={"requests": Requests(audit=AuditRequest(id=request))})


def test_an_unrecorded_running_run_is_adopted_not_doubled(events: list[Any]) -> None:
    kube = MemoryKube()
    spec = requested(spec_with(), "r1")
    orphan = build_audit_job(CLUSTER, spec, "orders-audit-20261122095959", "schedule", "pair")
    orphan["metadata"]["creationTimestamp"] = "2026-11-22T09:59:59Z"
    kube.ensure(orphan)
    status = BrokerClusterStatus()
    runner(kube, spec, status).reconcile(T0, T0)
    assert len(kube.objects) == 1
    assert status.last_audit is not None and status.last_audit.run == orphan["metadata"]["name"]
    assert status.last_audit.verdict == "RUNNING" and status.last_audit.reason == "schedule"


def test_a_run_past_its_timeout_is_deleted_and_recorded_as_error(events: list[Any]) -> None:
    kube = MemoryKube()
    spec = requested(spec_with(timeoutSeconds=60), "r1")
    status = BrokerClusterStatus()
    runner(kube, spec, status).reconcile(T0, T0)
    assert status.last_audit is not None
    run = status.last_audit.run
    assert ("Job", run) in kube.objects and events[-1][0] == "AuditStarted"
    runner(kube, spec, status).reconcile(T0, T0 + timedelta(seconds=61))
    assert kube.deleted == [run]
    assert status.last_audit.verdict == "ERROR" and "timeoutSeconds" in status.last_audit.message
    assert [c.status for c in status.conditions if c.type == "AuditPassed"] == ["Unknown"]
    assert events[-1][0] == "AuditError"


def test_without_the_spark_operator_a_run_ends_at_once_saying_so(events: list[Any]) -> None:
    spec = requested(spec_with(launcher="sparkApplication"), "r1")
    status = BrokerClusterStatus()
    runner(MemoryKube(spark_api=False), spec, status).reconcile(T0, T0)
    assert status.last_audit is not None and status.last_audit.verdict == "ERROR"
    assert "install the Kubeflow Spark Operator" in status.last_audit.message
    assert status.handled_requests.audit == "r1"


def test_an_audit_problem_never_escapes_and_is_posted_once(events: list[Any]) -> None:
    class NoSecret(MemoryKube):
        def get_secret_data(self, namespace: str, name: str) -> dict[str, str]:
            raise RuntimeError(f'secrets "{name}" not found')

    kube = NoSecret()
    spec = requested(spec_with(), "r1")
    status = BrokerClusterStatus()
    runner(kube, spec, status).reconcile(T0, T0)
    job = kube.objects[("Job", status.last_audit.run if status.last_audit else "")]
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    first = runner(kube, spec, status).reconcile_guarded(T0, T0, None)
    assert first is not None and 'secrets "s3" not found' in first
    again = runner(kube, spec, status).reconcile_guarded(T0, T0, first)
    assert again == first
    assert [reason for reason, _ in events].count("AuditProblem") == 1
    assert status.last_audit is not None and status.last_audit.verdict == "RUNNING"  # retried


class StoreKube(MemoryKube):
    """MemoryKube whose store Secret is empty (a local store needs no credentials)."""

    def get_secret_data(self, namespace: str, name: str) -> dict[str, str]:
        return {}


def test_a_dr_switch_launches_a_cross_site_run_and_its_summary_is_recorded(
    events: list[Any], tmp_path: Any
) -> None:
    from twinmq.audit.store import Store
    from twinmq.operator.models import MirrorState

    kube = StoreKube()
    spec = spec_with(storeUrl=str(tmp_path / "a"), mirrorStoreUrl=MIRROR_STORE)
    status = BrokerClusterStatus()
    status.mirror = MirrorState(role="source", state="Connected", epoch=2)
    runner(kube, spec, status).reconcile(T0, T0)  # the epoch is seen: the wait starts
    assert status.last_audit is None and status.audit.dr_epoch_seen == iso(T0)
    settled = T0 + timedelta(seconds=failover_settle_seconds(spec.audit))
    runner(kube, spec, status).reconcile(T0, settled)
    run = status.last_audit
    assert run is not None and (run.verdict, run.scope) == ("RUNNING", "sites")
    assert events[-1] == ("AuditStarted", f"cross-site audit run {run.run} started (DR switch "
                          "to epoch 2) as a Job")  # fmt: skip
    job = kube.objects[("Job", run.run)]
    assert "--mirror-store" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    # The program writes its summary where `twinmq audit --mirror-store` does (audit/cross.py).
    summary = cross_summary(Verdict.FAIL, ["1 confirmed messages missing"], messages=9, lost=1)
    Store(str(tmp_path / "a")).write_json(
        f"audit/cross/{run.run}/summary.json", summary.model_dump(mode="json")
    )
    job["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    runner(kube, spec, status).reconcile(T0, settled + timedelta(minutes=1))
    result = status.last_audit
    assert result is not None and (result.verdict, result.lost, result.scope) == (
        "FAIL",
        1,
        "sites",
    )
    assert [c.status for c in status.conditions if c.type == "AuditPassed"] == ["False"]
    assert status.audit.audited_dr_epoch == 2


def test_a_run_whose_pod_no_node_takes_says_why_once(events: list[Any]) -> None:
    kube = MemoryKube()
    spec = requested(spec_with(), "r1")
    status = BrokerClusterStatus()
    runner(kube, spec, status).reconcile(T0, T0)
    assert status.last_audit is not None
    run = status.last_audit.run
    why = "0/1 nodes are available: 1 Insufficient cpu."
    kube.ensure({
        "kind": "Pod", "metadata": {"name": f"{run}-x", "labels": {LABEL_RUN: run}},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": why}]},
    })  # fmt: skip
    for second in (1, 2):
        runner(kube, spec, status).reconcile(T0, T0 + timedelta(seconds=second))
    assert status.last_audit.verdict == "RUNNING"
    assert status.last_audit.message == f"waiting for a node: {why}"
    assert [r for r, _ in events].count("AuditPending") == 1
    kube.objects[("Pod", f"{run}-x")]["status"] = {"phase": "Running"}
    runner(kube, spec, status).reconcile(T0, T0 + timedelta(seconds=3))
    assert status.last_audit.message == "" and status.last_audit.verdict == "RUNNING"
