"""Monitoring (docs/monitoring.md): the alert rules and the Grafana dashboard in
helm/twinmq/monitoring, and the chart's PodMonitors, PrometheusRule and dashboard
ConfigMap (`monitoring.*` values).

What can go wrong and is checked here: a rule Prometheus would refuse to load, a query
that does not parse, a metric name no broker or operator exports (a renamed metric leaves
an alert that never fires), a PodMonitor that selects no broker pod, scrapes a port the
pod does not have, reads the admin token from the wrong Secret key, or relabels a pod label
that does not exist, and manifests the Prometheus Operator's CRDs would refuse.

Prometheus's own rule loader and PromQL parser (Go: monitoring/promcheck) and the
Prometheus Operator's CRD schemas (its Go module) need the Go toolchain; those tests are
skipped without `go` on PATH. No Python PromQL parser or promtool package is available.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from test_chart import CHART, KUBERNETES_VERSION, Obj, helm, kinds, one, render

from twinmq.broker.names import ADMIN_READ_TOKEN_ENV
from twinmq.operator import metrics as operator_metrics
from twinmq.operator.builders import ADMIN_SCHEME, ClusterRef, build_pod, pod_name, secret_name
from twinmq.operator.certs import ca_config_map_name, peer_names
from twinmq.operator.models import BrokerClusterSpec
from twinmq.testing.launcher import BrokerProcess

__all__ = ["helm"]  # the fixture, shared with test_chart.py

REPO = CHART.parent.parent
RULES = CHART / "monitoring" / "twinmq-rules.yaml"
DASHBOARD = CHART / "monitoring" / "twinmq-dashboard.json"
PROMCHECK = REPO / "monitoring" / "promcheck"
# The Prometheus Operator release whose CRDs (in its Go module) the manifests must fit.
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up"}

EVERYTHING = (
    "monitoring.podMonitor.enabled=true",
    "monitoring.podMonitor.labels.release=kube-prometheus-stack",
    "monitoring.podMonitor.interval=30s",
    "monitoring.podMonitor.brokerClusters[0].name=orders",
    "monitoring.podMonitor.brokerClusters[0].namespace=shop",
    "monitoring.podMonitor.brokerClusters[1].name=billing",
    "monitoring.podMonitor.brokerClusters[1].secretName=billing-credentials",
    "monitoring.podMonitor.brokerClusters[1].tls=false",
    "monitoring.prometheusRule.enabled=true",
    "monitoring.grafanaDashboard.enabled=true",
    "monitoring.grafanaDashboard.namespace=grafana",
)


def go() -> str:
    """The Go toolchain, or skip."""
    binary = shutil.which("go")
    if binary is None:
        pytest.skip("no go on PATH: Prometheus's parsers and the CRD schemas are Go modules")
    return binary


@pytest.fixture(scope="module")
def promcheck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """monitoring/promcheck built (Go's build cache makes a rebuild seconds)."""
    binary = tmp_path_factory.mktemp("promcheck") / "promcheck"
    subprocess.run([go(), "build", "-o", str(binary), "."], cwd=PROMCHECK, check=True, timeout=600)
    return binary


def exported(families: Iterable[Any]) -> set[str]:
    """The series names a set of metric families puts on /metrics, empty ones included
    (a labelled counter nobody has incremented yet is still a name a rule may use)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
    }
    return {
        family.name + suffix for family in families for suffix in suffixes.get(family.type, ("",))
    }


def operator_families() -> Iterator[Any]:
    """The families of the operator's registry (operator/metrics.py), as it serves them."""
    for value in vars(operator_metrics).values():
        if isinstance(value, MetricWrapperBase):
            yield from value.collect()


@pytest.fixture(scope="module")
def exported_names(broker: BrokerProcess) -> set[str]:
    """Every series name a real broker or the operator exports, and Prometheus's own."""
    broker_names = exported(text_string_to_metric_families(broker.admin.metrics()))
    assert "twinmq_role_active" in broker_names
    return broker_names | exported(operator_families()) | PROMETHEUS_SERIES


def rule_expressions() -> dict[str, str]:
    """Alert name -> expression, from the rule file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


GRAFANA_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
GRAFANA_INTERVALS = {"__rate_interval", "__interval", "__range"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*\w+\)$")


def as_promql(query: str) -> str:
    """A Grafana query as Prometheus sees it: intervals become `5m`, other variables
    (used only inside label matchers) a value; `label_values(selector, label)` is its
    selector."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return "5m" if name in GRAFANA_INTERVALS else "x"

    selector = LABEL_VALUES.match(query)
    return GRAFANA_VARIABLE.sub(value, selector["selector"] if selector else query)


def dashboard_queries() -> dict[str, str]:
    """Where -> PromQL, for every panel target and query variable of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = as_promql(target["expr"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            out[f"variable {variable['name']}"] = as_promql(variable["query"]["query"])
    return out


def parse(promcheck: Path, queries: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Where -> {error, metrics} from Prometheus's PromQL parser."""
    proc = subprocess.run(
        [str(promcheck), "exprs"], input=json.dumps(list(queries.values())),
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return dict(zip(queries, json.loads(proc.stdout), strict=True))


def test_the_rule_file_loads_in_prometheus(promcheck: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(promcheck), "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The checker itself refuses a broken rule (it is not a check that cannot fail).
    broken = tmp_path / "broken.yaml"
    broken.write_text(RULES.read_text().replace("expr: up{", "expr: up{{", 1))
    proc = subprocess.run([str(promcheck), "rules", str(broken)], capture_output=True, text=True)
    assert proc.returncode == 1 and "TwinMQBrokerDown" in proc.stdout


def test_every_rule_and_dashboard_query_parses_and_names_only_exported_metrics(
    promcheck: Path, exported_names: set[str]
) -> None:
    queries = {f"alert {name}": expr for name, expr in rule_expressions().items()}
    queries |= dashboard_queries()
    results = parse(promcheck, queries)
    errors = {where: r["error"] for where, r in results.items() if r.get("error")}
    assert errors == {}
    unknown = {
        where: sorted(set(r["metrics"]) - exported_names)
        for where, r in results.items()
        if set(r["metrics"]) - exported_names
    }
    assert unknown == {}, "metrics no broker or operator exports"
    used = {name for r in results.values() for name in r["metrics"]}
    # The checks see through the queries: the names they found are real ones.
    assert {"twinmq_role_active", "twinmq_operator_audits_total", "up"} <= used


@pytest.mark.slow
def test_alerts_fire_on_series_that_mean_trouble_and_only_then() -> None:
    """monitoring/promcheck/alerts_test.go: every alert's expression evaluated by
    Prometheus's engine over scenarios (two passive brokers, an unreachable active, lag,
    an alarm, failed Lease renewals, no operator leader, an audit FAIL, ...) and over
    healthy series returns exactly the label sets expected; every alert has a scenario."""
    proc = subprocess.run(
        [go(), "test", "-count=1", "./..."],
        cwd=PROMCHECK, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_cover_pair_health_the_operator_and_audits() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = {rule["alert"]: rule for group in groups for rule in group["rules"]}
    assert {
        "TwinMQNoActiveBroker", "TwinMQBrokerDown", "TwinMQPairDegraded",
        "TwinMQReplicationLag", "TwinMQResourceAlarm", "TwinMQBrokerDamaged",
        "TwinMQLeaseNotRenewed", "TwinMQSelfFenced", "TwinMQOperatorDown",
        "TwinMQAuditFailed",
    } <= set(rules)  # fmt: skip
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def monitoring_docs(helm: Callable[..., str]) -> list[Obj]:
    """The chart's manifests with every monitoring value on."""
    return render(helm, *EVERYTHING, namespace="tmq")


def test_monitoring_objects_render_only_when_asked(helm: Callable[..., str]) -> None:
    monitoring_kinds = {"PodMonitor", "PrometheusRule", "ConfigMap"}
    assert not monitoring_kinds & set(kinds(render(helm)))
    docs = monitoring_docs(helm)
    assert kinds(docs).count("PodMonitor") == 3  # the operator, orders, billing
    assert one(docs, "PrometheusRule")["spec"] == yaml.safe_load(RULES.read_text())
    dashboard = one(docs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "grafana"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["twinmq-dashboard.json"]) == json.loads(
        DASHBOARD.read_text()
    )


def crd_schemas() -> dict[str, Obj]:
    """kind -> the v1 openAPIV3Schema of the Prometheus Operator's CRDs (its Go module)."""
    proc = subprocess.run(
        [go(), "mod", "download", "-json", PROMETHEUS_OPERATOR],
        cwd=PROMCHECK, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = Path(json.loads(proc.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    out = {}
    for name in ("podmonitors", "prometheusrules"):
        crd = yaml.safe_load((folder / f"monitoring.coreos.com_{name}.yaml").read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        out[crd["spec"]["names"]["kind"]] = strict(version["schema"]["openAPIV3Schema"])
    return out


def strict(schema: Obj) -> Obj:
    """The schema refusing unknown fields, as `kubectl apply` (strict field validation)
    does: a misspelt key would otherwise be dropped silently by the API server."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        return [strict(item) for item in schema]  # type: ignore[return-value]
    return schema


def test_monitoring_manifests_fit_the_prometheus_operator_crds_and_kubernetes(
    helm: Callable[..., str],
) -> None:
    import jsonschema
    import kubernetes_validate

    schemas = crd_schemas()

    def error(doc: Obj) -> str | None:
        found = jsonschema.exceptions.best_match(
            jsonschema.Draft7Validator(schemas[doc["kind"]]).iter_errors(doc)
        )
        return None if found is None else f"{found.message} at {list(found.path)}"

    docs = monitoring_docs(helm)
    for doc in docs:
        if doc["kind"] in schemas:
            assert error(doc) is None, f"{doc['kind']} {doc['metadata']['name']}"
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # The schemas refuse what the API server would (a misspelt field, a bad type).
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["honourLabels"] = True
    assert "honourLabels" in (error(monitor) or "")
    rule = one(docs, "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = 60
    assert error(rule) is not None


CLUSTER = ClusterRef(name="orders", namespace="shop", uid="u-1")


def relabel_source(pod_label: str) -> str:
    """The meta label Prometheus's Kubernetes discovery gives a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def matches(selector: Obj, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, Exists expressions) selects `labels`."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "Exists", expression
        if expression["key"] not in labels:
            return False
    return True


@pytest.mark.parametrize("broker", ["primary", "backup"])
def test_broker_pod_monitor_scrapes_the_operators_broker_pods_with_their_read_only_token(
    helm: Callable[..., str], broker: str
) -> None:
    docs = [d for d in monitoring_docs(helm) if d["kind"] == "PodMonitor"]
    (monitor,) = [d for d in docs if d["metadata"]["name"] == "orders-brokers"]
    assert monitor["metadata"]["namespace"] == CLUSTER.namespace
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [CLUSTER.namespace]}
    # A cluster with the default spec.tls, at its last step: admin HTTPS, per-broker names.
    pod = build_pod(CLUSTER, BrokerClusterSpec(), broker, peer_tls="Required")  # type: ignore[arg-type]
    labels = pod["metadata"]["labels"]
    assert matches(spec["selector"], labels)
    assert not matches(spec["selector"], {**labels, "twinmq.io/cluster": "billing"})
    # One endpoint per broker, each keeping that broker's pod only.
    kept = {
        r["regex"]: e for e in spec["podMetricsEndpoints"] for r in e["relabelings"]
        if r.get("action") == "keep"
    }  # fmt: skip
    assert set(kept) == {"primary", "backup"} and len(spec["podMetricsEndpoints"]) == 2
    endpoint = kept[broker]
    (container,) = pod["spec"]["containers"]
    assert endpoint["port"] in {port["name"] for port in container["ports"]}
    assert endpoint["path"] == "/metrics"
    # HTTPS, verified against the CA the operator publishes, by the name the broker's own
    # certificate carries (its pod's).
    assert pod["metadata"]["annotations"][ADMIN_SCHEME] == "https"
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "ca": {"configMap": {"name": ca_config_map_name(CLUSTER), "key": "ca.crt"}},
        "serverName": pod_name(CLUSTER, broker),  # type: ignore[arg-type]
    }
    assert pod_name(CLUSTER, broker) in peer_names(CLUSTER, broker)  # type: ignore[arg-type]
    # The read-only token: a scrape's credentials cannot change a role.
    token = next(e for e in container["env"] if e["name"] == ADMIN_READ_TOKEN_ENV)
    ref = token["valueFrom"]["secretKeyRef"]
    assert endpoint["authorization"] == {
        "type": "Bearer", "credentials": {"name": ref["name"], "key": ref["key"]},
    }  # fmt: skip
    assert ref["name"] == secret_name(CLUSTER, BrokerClusterSpec())
    # brokercluster and broker come from pod labels the operator sets; `brokercluster` is
    # the label the operator's own per-cluster series carry.
    relabelled = {
        r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"] if "targetLabel" in r
    }
    assert relabelled["brokercluster"] == [relabel_source("twinmq.io/cluster")]
    assert relabelled["broker"] == [relabel_source("twinmq.io/broker")]
    assert labels["twinmq.io/cluster"] == CLUSTER.name and labels["twinmq.io/broker"] == broker
    assert set(relabelled) >= set(operator_metrics.CLUSTER_LABELS) - {"namespace"}


def test_broker_pod_monitor_uses_the_secret_named_in_the_values(
    helm: Callable[..., str],
) -> None:
    docs = [d for d in monitoring_docs(helm) if d["kind"] == "PodMonitor"]
    (monitor,) = [d for d in docs if d["metadata"]["name"] == "billing-brokers"]
    assert monitor["metadata"]["namespace"] == "tmq"  # the release's
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["authorization"]["credentials"] == {
        "name": "billing-credentials", "key": "metrics-token",
    }  # fmt: skip
    # `tls: false` (a cluster with its own Secret or TLS off): its admin API is HTTP.
    assert "scheme" not in endpoint and "tlsConfig" not in endpoint


def test_operator_pod_monitor_scrapes_the_metrics_port_and_keeps_cluster_labels(
    helm: Callable[..., str],
) -> None:
    docs = monitoring_docs(helm)
    deployment = one(docs, "Deployment")
    (monitor,) = [
        d for d in docs
        if d["kind"] == "PodMonitor" and d["metadata"]["name"] == deployment["metadata"]["name"]
    ]  # fmt: skip
    spec = monitor["spec"]
    assert matches(spec["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert spec["namespaceSelector"] == {"matchNames": ["tmq"]}
    (endpoint,) = spec["podMetricsEndpoints"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports[endpoint["port"]] == operator_metrics.DEFAULT_PORT
    assert endpoint["interval"] == "30s"
    # The operator's per-cluster series name the BrokerCluster's namespace: it must win.
    assert endpoint["honorLabels"] is True
    audits = next(iter(operator_metrics.AUDITS.describe()))
    assert audits.name == "twinmq_operator_audits"
    assert operator_metrics.AUDITS._labelnames == ("verdict", *operator_metrics.CLUSTER_LABELS)


def test_operator_pod_monitor_is_not_rendered_without_an_operator(
    helm: Callable[..., str],
) -> None:
    docs = render(helm, *EVERYTHING, "operator.enabled=false")
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "PodMonitor"}
    assert names == {"orders-brokers", "billing-brokers"}


def test_labelled_families_with_no_sample_yet_count_as_exported(
    exported_names: set[str],
) -> None:
    # No protocol error happened on the test broker: the family is on /metrics by name
    # only, and a rule on it is still sound.
    assert "twinmq_protocol_errors_total" in exported_names
    assert "twinmq_no_such_metric" not in exported_names
