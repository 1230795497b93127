"""Pure builders of audit runs: a Job running Spark locally, or a SparkApplication.

Both run the same program (`twinmq-audit`, which `spark-apps/replication_audit.py`
wraps) on the cluster's store, named after the run so the operator finds its
summary at `audit/runs/<run>/summary.json`.
"""

from __future__ import annotations

from datetime import datetime

from twinmq.operator.builders import ClusterRef, Obj, labels, owned_meta
from twinmq.operator.mirroring import site_id
from twinmq.operator.models import AuditScope, BrokerClusterSpec

LABEL_RUN = "twinmq.io/audit-run"
ANNOTATION_REASON = "twinmq.io/audit-reason"
ANNOTATION_SCOPE = "twinmq.io/audit-scope"
"""pair or sites: an adopted run (an operator died before recording it) is read right."""
SPARK_APP_FILE = "local:///opt/twinmq/spark-apps/replication_audit.py"
"""Where the project's image carries the Spark application."""
SPARK_VERSION = "4.3.0"
"""The Spark of the project's image (PySpark's version)."""
SCRATCH = "/var/run/twinmq-tmp"
"""Scratch space of a local-mode run (Spark's local dirs, copies of S3 objects)."""
SPARK_API = "sparkoperator.k8s.io/v1beta2"


def run_name(cluster: ClusterRef, now: datetime) -> str:
    """`<cluster>-audit-<UTC time>`, short enough for the Job's pod labels and the Spark
    driver's pod name (`<run>-driver`, at most 63 characters)."""
    return f"{cluster.name[:35]}-audit-{now:%Y%m%d%H%M%S}"


def memory_quantity(spark_memory: str, overhead_mib: int = 0) -> str:
    """A Spark memory amount (`2g`) as a Kubernetes quantity in MiB, plus an overhead."""
    value, unit = int(spark_memory[:-1]), spark_memory[-1]
    mib = {"k": value / 1024, "m": value, "g": value * 1024, "t": value * 1024 * 1024}[unit]
    return f"{int(mib) + overhead_mib}Mi"


def _run_meta(cluster: ClusterRef, name: str, reason: str, scope: AuditScope) -> Obj:
    meta = owned_meta(cluster, name)
    meta["labels"][LABEL_RUN] = name
    meta["annotations"] = {ANNOTATION_REASON: reason, ANNOTATION_SCOPE: scope}
    return meta


def _store_env(spec: BrokerClusterSpec) -> list[Obj]:
    secret = spec.audit.store_secret_name
    return [{"secretRef": {"name": secret}}] if secret else []


def audit_args(
    cluster: ClusterRef, spec: BrokerClusterSpec, name: str, scope: AuditScope
) -> list[str]:
    """The program's arguments common to both launchers: the pair's audit, or (`sites`)
    this DR site's store against the other sites' (its summary under `audit/cross/<run>/`).

    With a ring's or a mesh's further stores the run is told this site's own mirror id
    (first in store order): the other sites' ids follow from the logs by elimination,
    which a ring of three needs (docs/audit.md, "Three sites or more")."""
    assert spec.audit.store_url is not None  # the CRD requires it when audits are enabled
    args = ["--store", spec.audit.store_url, "--run-id", name]
    if scope == "sites":
        assert spec.audit.mirror_store_url is not None  # the planner checks it
        args += ["--mirror-store", spec.audit.mirror_store_url]
        more = spec.audit.more_mirror_store_urls or []
        for url in more:
            args += ["--mirror-store", url]
        if more:
            own = site_id(cluster.namespace, cluster.name)  # its events' origin
            args += ["--site-ids", ",".join([own, *([""] * (1 + len(more)))])]
    return args


def build_audit_job(
    cluster: ClusterRef, spec: BrokerClusterSpec, name: str, reason: str, scope: AuditScope
) -> Obj:
    """A Job running the audit with Spark in local mode (no Spark Operator needed)."""
    res = spec.audit.resources
    run_labels = {**labels(cluster), LABEL_RUN: name}
    # The JVM heap plus Python, Arrow and the JVM's own overhead.
    memory = memory_quantity(res.driver_memory, overhead_mib=768)
    container: Obj = {
        "name": "audit",
        "image": spec.audit.image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["twinmq-audit"],
        "args": [
            *audit_args(cluster, spec, name, scope),
            f"--master=local[{res.driver_cores}]",
            f"--conf=spark.driver.memory={res.driver_memory}",
            f"--conf=spark.local.dir={SCRATCH}/spark",
            f"--work-dir={SCRATCH}/store",
        ],
        "env": [{"name": "TMPDIR", "value": SCRATCH}],
        "resources": {
            "requests": {"cpu": str(res.driver_cores), "memory": memory},
            "limits": {"memory": memory},
        },
        "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH}],
    }
    if env_from := _store_env(spec):
        container["envFrom"] = env_from
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _run_meta(cluster, name, reason, scope),
        "spec": {
            # The verdict is the exit code (1: FAIL): a failed audit is never retried.
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": run_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                },
            },
        },
    }


SPARK_DRIVER_CONTAINER = "spark-kubernetes-driver"
"""The name the Spark Operator gives the driver's container in its pod template."""
SPARK_DRIVER_SCRIPT = (
    "shift; exec spark-submit --deploy-mode client "
    '--conf "spark.driver.bindAddress=$SPARK_DRIVER_BIND_ADDRESS" "$@"'
)
"""What Spark's own image entrypoint does for `driver ARGS` (the project's image has no
Spark entrypoint): spark-submit in client mode inside the driver pod."""


SPARK_CONF = {
    "spark.kubernetes.driver.pod.excludedFeatureSteps": (
        "org.apache.spark.deploy.k8s.features.NetworkPolicyFeatureStep"
    ),
}
"""Found on a real Spark Operator (issue 13): Spark 4 creates a NetworkPolicy for every
driver (ingress from the application's executors only), which the Spark Operator v2.3.0
chart's Role does not allow its controller to create (spark-submit then deletes the
driver pod and the application fails). The audit starts no executors."""


def _driver_template(spec: BrokerClusterSpec, pod_labels: dict[str, str]) -> Obj:
    """The driver's pod template: the Spark Operator hands it to spark-submit
    (`spark.kubernetes.driver.podTemplateFile`), which keeps its command, environment and
    volumes. Found on a real Spark Operator (issue 13): Spark starts the driver container
    with the arguments `driver --properties-file ...` and the image's entrypoint, so
    without a command the project's image would run `driver` as a program; `envFrom` on
    the SparkApplication is applied only by the Spark Operator's mutating webhook, which
    a cluster may not run, while a template's `envFrom` always reaches the pod."""
    container: Obj = {
        "name": SPARK_DRIVER_CONTAINER,
        "command": ["/usr/bin/tini", "--", "/bin/sh", "-c", SPARK_DRIVER_SCRIPT, "spark-driver"],
        "env": [{"name": "TMPDIR", "value": SCRATCH}],
        "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH}],
    }
    if env_from := _store_env(spec):
        container["envFrom"] = env_from
    return {
        "metadata": {"labels": pod_labels},
        "spec": {"containers": [container], "volumes": [{"name": "scratch", "emptyDir": {}}]},
    }


def build_spark_application(
    cluster: ClusterRef, spec: BrokerClusterSpec, name: str, reason: str, scope: AuditScope
) -> Obj:
    """A SparkApplication for the Kubeflow Spark Operator (cluster mode, never restarted).

    The audit runs inside the driver pod, Spark in local mode with `driverCores` threads:
    executors would read the store through the s3a connector (hadoop-aws), which the
    project's audit image does not carry; without it the driver copies what it reads to
    its own scratch space, which executor pods cannot see. The executor settings are
    passed on as given (the Spark Operator requires them); no executor pod starts."""
    res = spec.audit.resources
    pod_labels = {**labels(cluster), LABEL_RUN: name}
    driver: Obj = {
        "cores": res.driver_cores,
        "memory": res.driver_memory,
        # Python, Arrow and the JVM's own overhead, as for the Job (Spark's default, 10 %
        # but at least 384 MiB, is too little for the Python side).
        "memoryOverhead": "768m",
        "serviceAccount": spec.audit.service_account_name,
        "labels": pod_labels,
        "template": _driver_template(spec, pod_labels),
    }
    executor: Obj = {
        "instances": res.executor_instances,
        "cores": res.executor_cores,
        "memory": res.executor_memory,
        "labels": pod_labels,
    }
    return {
        "apiVersion": SPARK_API,
        "kind": "SparkApplication",
        "metadata": _run_meta(cluster, name, reason, scope),
        "spec": {
            "type": "Python",
            "pythonVersion": "3",
            "mode": "cluster",
            "image": spec.audit.image or spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "mainApplicationFile": SPARK_APP_FILE,
            "arguments": [
                *audit_args(cluster, spec, name, scope),
                f"--master=local[{res.driver_cores}]",
                f"--conf=spark.local.dir={SCRATCH}/spark",
                f"--work-dir={SCRATCH}/store",
            ],
            "sparkVersion": SPARK_VERSION,
            "sparkConf": SPARK_CONF,
            "restartPolicy": {"type": "Never"},
            "driver": driver,
            "executor": executor,
        },
    }
