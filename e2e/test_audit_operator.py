"""Audits launched by the operator, end to end.

The store is an S3-compatible server (moto in server mode, the stand-in for S3 or
MinIO) running as a process of this checkout's venv on the node's address, behind a
Service without selector whose EndpointSlice names that address
(`s3server.host_server`): no image carries moto, so the same test runs with the node
agent and with the real kubelet. The brokers' shipper sidecars, the audit runs and the
operator (a local process) all reach it at the Service's cluster IP. The `job` launcher
runs the real Spark audit in a pod of the audit image (`AUDIT_IMAGE`: JRE + PySpark;
`make image-audit` for the real node) after a kill -9 failover. The `sparkApplication`
launcher's objects are validated by the API server against the Spark Operator's own CRD
(from its Go module); no Spark Operator runs here, so this test plays its part: it moves
the application's status through its states and, for the completed run, does the driver's
work by running the same audit program on the same store.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
import yaml
from brokerclusters import (
    CRD_PATH,
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    condition,
    create_cluster,
    messages_in,
    publish_some,
)
from support import AUDIT_IMAGE, Cluster, helm, kubectl_binary, new_namespace, plugin, pod_path

from twinmq.audit.store import Store
from twinmq.audit.summary import AuditSummary, CrossSiteSummary
from twinmq.client import ReliablePublisher
from twinmq.localcluster import binaries, faults, s3server
from twinmq.localcluster.layout import Layout
from twinmq.operator.audit_runner import store_options
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
SPARK_OPERATOR_MODULE = "github.com/kubeflow/spark-operator/v2@v2.3.0"
SPARK_CRD = "config/crd/bases/sparkoperator.k8s.io_sparkapplications.yaml"
SPARK_API = "/apis/sparkoperator.k8s.io/v1beta2"
BUCKET = "audits"


@pytest.fixture(scope="module")
def s3_endpoint(cluster: Cluster, operator: OperatorProcess) -> Iterator[str]:
    """An S3-compatible server on the node's address behind a Service (in its own namespace),
    for the module's tests; its URL (the Service's cluster IP)."""
    namespace = f"e2e-s3-{uuid.uuid4().hex[:6]}"
    kube = cluster.kube
    kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    log = Layout.default().logs / "e2e-s3.log"
    try:
        with s3server.host_server(log) as port:
            service, endpoints = s3server.host_manifests(port)
            url = s3server.endpoint(
                kube.create(f"/api/v1/namespaces/{namespace}/services", service)
            )
            kube.create(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                        endpoints)  # fmt: skip
            wait_for("the S3 API answers through the Service",
                     lambda: s3server.try_create_bucket(url, BUCKET), 30)  # fmt: skip
            yield url
    finally:
        kube.delete(f"/api/v1/namespaces/{namespace}")


def _store_secret(cluster: Cluster, namespace: str, url: str) -> None:
    secret = s3server.store_secret("audit-store", url)
    cluster.kube.create(f"/api/v1/namespaces/{namespace}/secrets", secret)


def _audit_spec(namespace: str, **fields: Any) -> dict[str, Any]:
    return {
        "enabled": True, "storeUrl": f"s3://{BUCKET}/{namespace}",
        "storeSecretName": "audit-store", "segmentSeconds": 2, "historyLimit": 1,
        "resources": {"driverMemory": "1g"}, "image": AUDIT_IMAGE, **fields,
    }  # fmt: skip


def _last_audit(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return dict(cluster_status(cluster, namespace, name).get("lastAudit") or {})


def _request_audit(cluster: Cluster, namespace: str, name: str, request: str) -> str:
    """Request an audit; return the run it started."""
    cluster.kube.patch(
        cluster_path(namespace, name), {"spec": {"requests": {"audit": {"id": request}}}}
    )

    def started() -> str | None:
        status = cluster_status(cluster, namespace, name)
        last = status.get("lastAudit") or {}
        handled = (status.get("handledRequests") or {}).get("audit") == request
        return str(last["run"]) if handled and "requested" in last.get("reason", "") else None

    # A bound for a loaded machine (30 s was passed once in a kubelet-mode make test).
    return wait_for(f"audit request {request} starts a run", started, timeout=120)


def _finished(cluster: Cluster, namespace: str, name: str, run: str, timeout: float) -> Any:
    def done() -> dict[str, Any] | None:
        last = _last_audit(cluster, namespace, name)
        return last if last.get("run") == run and last.get("verdict") != "RUNNING" else None

    return wait_for(f"audit run {run} finishes", done, timeout=timeout)


def _summary(namespace: str, run: str, endpoint: str) -> AuditSummary:
    """A run's summary, read from the store as the operator reads it."""
    store = Store(f"s3://{BUCKET}/{namespace}", store_options({**s3server.CREDENTIALS,
                  "AWS_ENDPOINT_URL": endpoint}))  # fmt: skip
    return AuditSummary.model_validate(store.read_json(f"audit/runs/{run}/summary.json"))


def _events(cluster: Cluster, namespace: str, name: str) -> list[str]:
    items = cluster.kube.list(f"/api/v1/namespaces/{namespace}/events") or []
    return [e["reason"] for e in items if e.get("involvedObject", {}).get("name") == name]


def _failover_audit(cluster: Cluster, namespace: str, name: str, total: int) -> str:
    """Confirmed traffic with a kill -9 of the primary broker halfway; return the audit run
    the operator starts on its own for that failover."""
    url = amqp_url(cluster, namespace, name)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare("orders", durable=True)
    conn.close()

    async def traffic() -> None:
        publisher = ReliablePublisher([url], reconnect_delay=0.2, give_up_after=90)
        for i in range(total):
            await publisher.publish(str(i).encode(), "orders", message_id=f"o-{i}")
            if i == total // 2:
                faults.kill_pod(Layout.default(), namespace, f"{name}-primary", "broker")
        await publisher.close()

    asyncio.run(traffic())
    status = cluster_status(cluster, namespace, name)
    assert status["activeBroker"] == "backup", status
    epoch = status["lastFailover"]["epoch"]

    # The old primary rejoins as passive; once both are in sync (and their segments
    # around the failover are shipped) the operator audits the failover on its own.
    def failover_audit() -> str | None:
        last = _last_audit(cluster, namespace, name)
        return last.get("run") if f"epoch {epoch}" in last.get("reason", "") else None

    return str(wait_for("the after-failover audit starts", failover_audit, timeout=120))


# Two Spark audits of up to 300 s each; on the real node the first test also starts the
# cluster (containerd, image imports) in its setup.
@pytest.mark.timeout(900)
def test_the_job_launcher_audits_a_failover_and_reports_pass(
    cluster: Cluster, operator: OperatorProcess, namespace: str, s3_endpoint: str
) -> None:
    _store_secret(cluster, namespace, s3_endpoint)
    name = create_cluster(cluster, namespace, audit=_audit_spec(namespace))
    pod = cluster.kube.get(pod_path(namespace, f"{name}-primary")) or {}
    assert [c["name"] for c in pod["spec"]["containers"]] == ["broker", "audit-ship"]
    total = 300
    run = _failover_audit(cluster, namespace, name, total)
    job = cluster.kube.get(f"/apis/batch/v1/namespaces/{namespace}/jobs/{run}")
    assert job is not None and job["metadata"]["ownerReferences"][0]["name"] == name
    result = _finished(cluster, namespace, name, run, timeout=300)
    assert result["verdict"] == "PASS", result
    # Every confirmed message has its confirm record, the killed broker's included.
    totals = _summary(namespace, run, s3_endpoint).totals
    assert result["lost"] == 0 and totals.messages >= total, totals
    assert condition(cluster_status(cluster, namespace, name), "AuditPassed") == "True"
    assert {"AuditStarted", "AuditPassed"} <= set(_events(cluster, namespace, name))

    # A requested run: incremental on the same store; historyLimit 1 keeps only its Job.
    second = _request_audit(cluster, namespace, name, "now-1")
    assert _finished(cluster, namespace, name, second, timeout=300)["verdict"] == "PASS"
    jobs = cluster.kube.list(
        f"/apis/batch/v1/namespaces/{namespace}/jobs", labelSelector="twinmq.io/audit-run"
    )
    assert [j["metadata"]["name"] for j in jobs] == [second]


@pytest.mark.timeout(900)
def test_a_dr_switchover_is_audited_across_the_two_sites_by_the_operator_and_passes(
    cluster: Cluster, operator: OperatorProcess, namespace: str, s3_endpoint: str
) -> None:
    """Two sites (namespaces), each shipping to its own prefix of the store; site B names
    site A's store as its mirror store. After a declared switchover (A demoted, B
    promoted) with confirmed traffic on both sides of it, B's operator launches the
    cross-site audit by itself, and it reports PASS."""
    site_b = new_namespace(cluster, "e2e-dr")
    try:
        token = base64.b64encode(b"a-shared-mirror-token").decode()
        for ns in (namespace, site_b):
            _store_secret(cluster, ns, s3_endpoint)
            secret = {"metadata": {"name": "orders-dr"}, "data": {"mirror-token": token}}
            cluster.kube.create(f"/api/v1/namespaces/{ns}/secrets", secret)

        def mirror(role: str, other: str) -> dict[str, Any]:
            return {"role": role, "secretName": "orders-dr",
                    "target": {"host": f"orders.{other}.svc"}}  # fmt: skip

        # Four brokers and the audit's driver core on a two-core node: small requests.
        small = {"requests": {"cpu": "100m", "memory": "256Mi"}}
        b_audit = _audit_spec(site_b, mirrorStoreUrl=f"s3://{BUCKET}/{namespace}")
        b_spec = {"mirror": mirror("replica", namespace), "resources": small}
        b = create_cluster(cluster, site_b, audit=b_audit, spec=b_spec)
        a_spec = {"mirror": mirror("source", site_b), "resources": small}
        a = create_cluster(cluster, namespace, audit=_audit_spec(namespace), spec=a_spec)
        a_url, b_url = amqp_url(cluster, namespace, a), amqp_url(cluster, site_b, b)
        publish_some(a_url, "orders", range(60))
        wait_for("A's messages on B", lambda: messages_in(b_url, "orders") == 60, 90)
        shown = plugin(cluster, "mirror", "switchover", a, f"{site_b}/{b}",
                       "-n", namespace, "--timeout", "120")  # fmt: skip
        assert shown.returncode == 0, shown.stdout + shown.stderr
        publish_some(b_url, "orders", range(60, 70))
        wait_for("B's messages mirrored back to A", lambda: messages_in(a_url, "orders") == 70, 90)

        def switch_audit() -> str | None:
            last = _last_audit(cluster, site_b, b)
            return last.get("run") if last.get("scope") == "sites" else None

        run = str(wait_for("B's operator starts the cross-site audit", switch_audit, 180))
        assert "DR switch to epoch" in _last_audit(cluster, site_b, b)["reason"]
        try:
            result = _finished(cluster, site_b, b, run, timeout=420)
        except TimeoutError as exc:
            job = cluster.kube.get(f"/apis/batch/v1/namespaces/{site_b}/jobs/{run}") or {}
            pods = cluster.kube.list(pod_path(site_b), labelSelector=f"job-name={run}") or []
            seen = [(p["metadata"]["name"], p.get("status")) for p in pods]
            raise AssertionError(f"{exc}; job status {job.get('status')}; pods {seen}; "
                                 f"events {_events(cluster, site_b, b)}") from exc  # fmt: skip
        assert result["verdict"] == "PASS", result
        assert result["lost"] == 0 and result["duplicates"] == 0 and result["messages"] >= 60
        store = Store(f"s3://{BUCKET}/{site_b}", store_options({**s3server.CREDENTIALS,
                      "AWS_ENDPOINT_URL": s3_endpoint}))  # fmt: skip
        summary = CrossSiteSummary.model_validate(
            store.read_json(f"audit/cross/{run}/summary.json")
        )
        assert [site.store for site in summary.sites] == [
            f"s3://{BUCKET}/{site_b}", f"s3://{BUCKET}/{namespace}",
        ]  # fmt: skip
        assert condition(cluster_status(cluster, site_b, b), "AuditPassed") == "True"
    finally:
        cluster.kube.delete(f"/api/v1/namespaces/{site_b}")


@pytest.fixture(scope="module")
def spark_operator_crd(cluster: Cluster) -> Iterator[None]:
    """The Spark Operator's SparkApplication CRD, as its Go module publishes it."""
    found = subprocess.run(
        ["go", "mod", "download", "-json", SPARK_OPERATOR_MODULE],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
    )  # fmt: skip
    if found.returncode != 0:
        pytest.fail(f"go mod download {SPARK_OPERATOR_MODULE}: {found.stdout}{found.stderr}")
    crd = yaml.safe_load((Path(json.loads(found.stdout)["Dir"]) / SPARK_CRD).read_text())
    path = f"{CRD_PATH}/{crd['metadata']['name']}"
    cluster.kube.apply(path, crd, "e2e")

    def established() -> bool:
        conds = ((cluster.kube.get(path) or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    wait_for("the SparkApplication CRD is established", established, timeout=60)
    yield


def _spark_state(cluster: Cluster, namespace: str, run: str, state: str, error: str = "") -> None:
    """What the Spark Operator writes as the application progresses."""
    app_state: dict[str, str] = {"state": state}
    if error:
        app_state["errorMessage"] = error
    cluster.kube.patch(
        f"{SPARK_API}/namespaces/{namespace}/sparkapplications/{run}/status",
        {"status": {"applicationState": app_state,
                    "driverInfo": {"podName": f"{run}-driver"}}},
    )  # fmt: skip


# A local Spark audit (the driver's work) on a loaded machine: past pytest's default 300 s
# once at load 20 (2026-11-27).
@pytest.mark.timeout(900)
def test_the_spark_application_launcher_follows_the_spark_operator_states(
    cluster: Cluster,
    operator: OperatorProcess,
    namespace: str,
    s3_endpoint: str,
    spark_operator_crd: None,
) -> None:
    _store_secret(cluster, namespace, s3_endpoint)
    audit = _audit_spec(namespace, launcher="sparkApplication", afterFailover=False,
                        resources={"executorInstances": 2})  # fmt: skip
    name = create_cluster(cluster, namespace, audit=audit)
    apps = f"{SPARK_API}/namespaces/{namespace}/sparkapplications"

    # 1. A run whose driver fails: ERROR, with the Spark Operator's message.
    run = _request_audit(cluster, namespace, name, "spark-1")
    app = cluster.kube.get(f"{apps}/{run}")  # accepted by the Spark Operator's schema
    assert app is not None
    assert app["spec"]["arguments"][:4] == ["--store", audit["storeUrl"], "--run-id", run]
    assert app["spec"]["executor"]["instances"] == 2
    for state in ("SUBMITTED", "RUNNING", "FAILING"):
        _spark_state(cluster, namespace, run, state)
        assert _last_audit(cluster, namespace, name)["verdict"] == "RUNNING"
    _spark_state(cluster, namespace, run, "FAILED", error="driver container exited with 137")
    result = _finished(cluster, namespace, name, run, timeout=30)
    assert result["verdict"] == "ERROR" and "exited with 137" in result["message"], result
    assert condition(cluster_status(cluster, namespace, name), "AuditPassed") == "Unknown"

    # 2. A run that completes: the driver's work (the same program, on the same store), then
    # COMPLETED; the operator reads the verdict from the store.
    run = _request_audit(cluster, namespace, name, "spark-2")
    _spark_state(cluster, namespace, run, "RUNNING")
    env = {**os.environ, **s3server.CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}
    driver = subprocess.run(
        [sys.executable, "-m", "twinmq.cli.audit", "audit", *app["spec"]["arguments"][:2],
         "--run-id", run, "--master", "local[1]", "--conf", "spark.driver.memory=1g"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stdout + driver.stderr
    assert _last_audit(cluster, namespace, name)["verdict"] == "RUNNING"
    _spark_state(cluster, namespace, run, "COMPLETED")
    result = _finished(cluster, namespace, name, run, timeout=30)
    assert result["verdict"] == "PASS", result
    assert condition(cluster_status(cluster, namespace, name), "AuditPassed") == "True"
    # historyLimit 1: the failed application is gone.
    names = [a["metadata"]["name"] for a in cluster.kube.list(apps)]
    assert names == [run]


SPARK_OPERATOR_NAMESPACE = "spark-operator"
SPARK_OPERATOR_BINARY = "/opt/spark-operator/spark-operator"
SPARK_HOME = "/opt/twinmq/lib/python3.11/site-packages/pyspark"
"""PySpark's Spark in the audit image: `bin/spark-submit` and the spark-kubernetes jars."""


def _spark_operator_manifests(
    cluster: Cluster, chart: Path, binary: Path, job_namespace: str
) -> str:
    """The Spark Operator's own chart, rendered by helm for the audit image.

    The one change to what a user installs: the image is the project's audit image (JRE +
    PySpark's spark-submit) with the controller binary, built from the Spark Operator's Go
    module, mounted read-only from the host's build cache (hostPath) instead of baked into
    an image; its command says where (the image's entrypoint is tini, not the Spark
    Operator's). The webhook is off (no certificates here): the SparkApplication must not
    depend on it."""
    registry, rest = AUDIT_IMAGE.split("/", 1)
    repository, tag = rest.rsplit(":", 1)
    volumes = [
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "controller", "hostPath": {"path": str(binary), "type": "File"}},
    ]
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "controller", "mountPath": SPARK_OPERATOR_BINARY, "readOnly": True},
    ]
    env = [{"name": "SPARK_HOME", "value": SPARK_HOME}, {"name": "HOME", "value": "/tmp"}]
    rendered = helm(
        cluster.kubeconfig, "template", "spark-operator", str(chart),
        "--namespace", SPARK_OPERATOR_NAMESPACE,
        "--set", f"image.registry={registry}", "--set", f"image.repository={repository}",
        "--set", f"image.tag={tag}", "--set", "image.pullPolicy=IfNotPresent",
        "--set", "webhook.enable=false", "--set", "controller.uiService.enable=false",
        "--set", "controller.leaderElection.enable=false",
        "--set", f"spark.jobNamespaces={{{job_namespace}}}",
        "--set-json", f"controller.volumes={json.dumps(volumes)}",
        "--set-json", f"controller.volumeMounts={json.dumps(mounts)}",
        "--set-json", f"controller.env={json.dumps(env)}",
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        # helm template leaves the release's namespace off some objects (the Deployment).
        if not doc["kind"].startswith("Cluster"):
            doc["metadata"].setdefault("namespace", SPARK_OPERATOR_NAMESPACE)
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container["command"] = ["/usr/bin/tini", "--", SPARK_OPERATOR_BINARY]
    return yaml.safe_dump_all(docs)


def _kubectl(cluster: Cluster, *args: str, stdin: str = "", check: bool = True) -> str:
    proc = subprocess.run(
        [kubectl_binary(), *args], input=stdin, capture_output=True, text=True, timeout=120,
        env={**os.environ, "KUBECONFIG": cluster.kubeconfig},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 or not check, f"kubectl {' '.join(args)}: {out}"
    return out


@pytest.fixture
def spark_operator(real_node: Cluster, namespace: str, spark_operator_crd: None) -> Iterator[None]:
    """The Kubeflow Spark Operator's controller running in the cluster, managing the test's
    namespace (where its chart also creates the driver's `spark-operator-spark` account)."""
    binary = binaries.build(next(b for b in binaries.BINARIES if b.name == "spark-operator"))
    found = subprocess.run(
        ["go", "mod", "download", "-json", SPARK_OPERATOR_MODULE],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "GOFLAGS": "-mod=mod"},
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    chart = Path(json.loads(found.stdout)["Dir"]) / "charts" / "spark-operator-chart"
    manifests = _spark_operator_manifests(real_node, chart, binary, namespace)
    kube = real_node.kube
    # Its controller also watches ScheduledSparkApplications and SparkConnects: all three
    # CRDs of its chart (server-side: too large for kubectl's last-applied annotation),
    # left installed as the module's SparkApplication CRD is.
    _kubectl(real_node, "apply", "--server-side", "--force-conflicts", "-f", str(chart / "crds"))
    kube.create("/api/v1/namespaces", {"metadata": {"name": SPARK_OPERATOR_NAMESPACE}})
    try:
        _kubectl(real_node, "apply", "-f", "-", stdin=manifests)

        def available() -> bool:
            path = f"/apis/apps/v1/namespaces/{SPARK_OPERATOR_NAMESPACE}/deployments"
            items = kube.list(path) or []
            return bool(items) and all((d.get("status") or {}).get("availableReplicas")
                                       for d in items)  # fmt: skip

        wait_for("the Spark Operator's controller is available", available, timeout=180)
        yield
    finally:
        log = _kubectl(real_node, "logs", "-n", SPARK_OPERATOR_NAMESPACE, "--tail=300",
                       "deployment/spark-operator-controller", check=False)  # fmt: skip
        (Layout.default().logs / "e2e-spark-operator.log").write_text(log)
        _kubectl(real_node, "delete", "--ignore-not-found", "--wait=false", "-f", "-",
                 stdin=manifests)  # fmt: skip
        kube.delete(f"/api/v1/namespaces/{SPARK_OPERATOR_NAMESPACE}")


# Spark's driver JVM and the audit on a loaded two-core machine: minutes.
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_spark_operator_runs_the_audit_of_a_failover_and_it_reports_pass(
    real_node: Cluster,
    operator: OperatorProcess,
    namespace: str,
    s3_endpoint: str,
    spark_operator: None,
) -> None:
    cluster = real_node
    _store_secret(cluster, namespace, s3_endpoint)
    audit = _audit_spec(namespace, launcher="sparkApplication")
    name = create_cluster(cluster, namespace, audit=audit)
    total = 300
    run = _failover_audit(cluster, namespace, name, total)
    apps = f"{SPARK_API}/namespaces/{namespace}/sparkapplications"
    app = cluster.kube.get(f"{apps}/{run}")
    assert app is not None and app["metadata"]["ownerReferences"][0]["name"] == name

    result = _finished(cluster, namespace, name, run, timeout=900)
    app = cluster.kube.get(f"{apps}/{run}") or {}
    state = (app.get("status") or {}).get("applicationState") or {}
    # The Spark Operator's message (spark-submit's output) in full when it failed.
    assert result["verdict"] == "PASS", f"{result}\n{state.get('errorMessage', '')[-6000:]}"
    assert state.get("state") == "COMPLETED", state
    # The driver ran in a pod of the audit image, started by the Spark Operator.
    driver = cluster.kube.get(pod_path(namespace, f"{run}-driver")) or {}
    assert driver["spec"]["containers"][0]["image"] == AUDIT_IMAGE
    assert driver["status"]["phase"] == "Succeeded", driver["status"]
    # Every confirmed message has its confirm record, the killed broker's included.
    totals = _summary(namespace, run, s3_endpoint).totals
    assert result["lost"] == 0 and totals.messages >= total, totals
    assert condition(cluster_status(cluster, namespace, name), "AuditPassed") == "True"
