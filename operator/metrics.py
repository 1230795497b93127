"""Prometheus metrics of the operator (served on :8081/metrics, `TWINMQ_OPERATOR_METRICS_PORT`;
the chart names that port `metrics`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# The labels naming a BrokerCluster, the same as the brokers' own series get from their
# pod labels by relabelling (helm/twinmq/templates/podmonitor-brokers.yaml); the chart's
# PodMonitor keeps them with honorLabels (docs/monitoring.md).
CLUSTER_LABELS = ("namespace", "brokercluster")
DEFAULT_PORT = 8081
"""The metrics port unless `TWINMQ_OPERATOR_METRICS_PORT` says otherwise."""

RECONCILIATIONS = Counter("twinmq_operator_reconciliations", "Reconciles run", ["outcome"])
PROBE_FAILURES = Counter(
    "twinmq_operator_probe_failures", "Broker admin probes that did not answer", ["broker"]
)
FAILOVERS = Counter(
    "twinmq_operator_failovers", "Active role moves (failover, switchover, recovery)", ["reason"]
)
FAILOVER_SECONDS = Histogram(
    "twinmq_operator_failover_seconds",
    "From the first sign of trouble to the new active's activation",
    buckets=(0.5, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 60),
)
DEGRADED = Gauge("twinmq_operator_degraded_clusters", "BrokerClusters not fully protected")
AUDITS_STARTED = Counter("twinmq_operator_audits_started", "Audit runs launched")
AUDITS = Counter(
    "twinmq_operator_audits",
    "Audit runs finished, by verdict and BrokerCluster",
    ["verdict", *CLUSTER_LABELS],
)
LEADER = Gauge(
    "twinmq_operator_leader",
    "1 while this replica holds the leader Lease and runs the handlers, 0 while it stands by",
)
DRIFT_REPAIRS = Counter(
    "twinmq_operator_drift_repairs",
    "Owned objects found deleted or edited and restored, by kind",
    ["kind"],
)
