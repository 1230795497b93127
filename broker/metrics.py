"""Prometheus metrics of the broker (one registry per process, the default one).

Two kinds. Metrics that change rarely (connections, roles, alarms, refusals) are
prometheus-client objects. Metrics that change per message or per group commit
(published, delivered, acked, confirms, confirm latency, fsync latency, batch
size, audit writes) are plain integers and floats (`FastCounter`,
`FastHistogram`) bumped by the event loop without locks or label lookups, and
read only at scrape time by `HotPathCollector`: prometheus-client's
lock-protected increments were 8 % of the instructions per message
(docs/benchmarks.md). They are written on the event loop only, and the scrape
runs on the same loop (broker/admin.py), so a scrape sees consistent values.
Names and types on `/metrics` are unchanged.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from twinmq.broker.api import TlsFilesStatus


class FastCounter:
    """A monotonic counter for the hot path: `inc` is one integer addition.

    Per-message call sites add to `value` directly (`metrics.DELIVERED.value += 1`):
    the method call costs more than the addition it makes.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        """Add `amount` (not negative)."""
        self.value += amount


class FastLabelledCounter:
    """A counter family with one label; children are created once and kept."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self.children: dict[str, FastCounter] = {}

    def labels(self, value: str) -> FastCounter:
        """The child for one label value (hot callers keep it, e.g. `CONFIRMS_ACK`)."""
        child = self.children.get(value)
        if child is None:
            child = self.children[value] = FastCounter()
        return child


class FastHistogram:
    """A histogram for the hot path: one bisect and two additions per observation."""

    __slots__ = ("bounds", "counts", "documentation", "name", "sum")

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        """Count one observation (`le` buckets: a value equal to a bound is in it)."""
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def family(self) -> HistogramMetricFamily:
        """The cumulative buckets and the sum, as Prometheus exposes a histogram."""
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            buckets.append((repr(bound), total))
        total += self.counts[-1]
        buckets.append(("+Inf", total))
        return HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=self.sum
        )


_COUNTERS: list[tuple[str, str, FastCounter]] = []
_LABELLED: list[FastLabelledCounter] = []
_HISTOGRAMS: list[FastHistogram] = []


def _counter(name: str, documentation: str) -> FastCounter:
    counter = FastCounter()
    _COUNTERS.append((name, documentation, counter))
    return counter


def _labelled(name: str, documentation: str, label: str) -> FastLabelledCounter:
    family = FastLabelledCounter(name, documentation, label)
    _LABELLED.append(family)
    return family


def _histogram(name: str, documentation: str, buckets: Sequence[float]) -> FastHistogram:
    histogram = FastHistogram(name, documentation, buckets)
    _HISTOGRAMS.append(histogram)
    return histogram


class HotPathCollector(Collector):
    """Exports the hot path's plain counters and histograms at scrape time."""

    def collect(self) -> Iterator[Metric]:
        """One family per fast metric, read now."""
        for name, documentation, counter in _COUNTERS:
            yield CounterMetricFamily(name, documentation, value=counter.value)
        for family in _LABELLED:
            metric = CounterMetricFamily(family.name, family.documentation, labels=[family.label])
            for value, child in sorted(family.children.items()):
                metric.add_metric([value], child.value)
            yield metric
        for histogram in _HISTOGRAMS:
            yield histogram.family()


CONNECTIONS = Gauge("twinmq_connections", "Open client connections")
CHANNELS = Gauge("twinmq_channels", "Open channels")
QUEUES = Gauge("twinmq_queues", "Declared queues")
# Per queue, labelled by `vhost` too: two vhosts' queues of one name are two series (a
# selector on `queue` alone still matches `/`'s queue, and the other vhosts' of that name).
QUEUE_MESSAGES = Gauge(
    "twinmq_queue_messages_ready", "Ready messages per queue", ["queue", "vhost"]
)
QUEUE_UNACKED = Gauge(
    "twinmq_queue_messages_unacknowledged",
    "Delivered, unacknowledged messages per queue",
    ["queue", "vhost"],
)
VHOST_MIRRORED = Gauge(
    "twinmq_vhost_mirrored",
    "Per vhost: 1 if the DR mirror carries it (every vhost one-way; `/` alone in the "
    "bidirectional mode and the mesh), 0 if it skips it (as /status says)",
    ["vhost"],
)
VHOST_FEDERATED = Gauge(
    "twinmq_vhost_federated",
    "Per vhost: 1 if federation serves it (every vhost: as /status says)",
    ["vhost"],
)
PUBLISHED = _counter(
    "twinmq_messages_published", "Messages routed to at least one queue or dropped"
)
UNROUTABLE = _counter("twinmq_messages_unroutable", "Published messages no queue took")
CAP_REFUSED = _counter(
    "twinmq_messages_refused_by_length_cap",
    "Publishes refused at the broker's queue length limit (--max-queue-length, "
    "--max-queue-length-bytes): a client's publish, a dead-lettered copy, or a "
    "transaction's whole commit",
)
DELIVERED = _counter("twinmq_messages_delivered", "Deliveries to consumers and basic.get")
ACKED = _counter("twinmq_messages_acknowledged", "Deliveries acknowledged by consumers")
REDELIVERED = _counter("twinmq_messages_requeued", "Deliveries returned to their queue")
EXPIRED = _counter("twinmq_messages_expired", "Messages dropped by TTL")
DEAD_LETTERED = _counter("twinmq_messages_dead_lettered", "Messages sent to a dead-letter exchange")
CONFIRMS = _labelled("twinmq_confirms", "Publisher confirms sent", "outcome")
CONFIRMS_ACK = CONFIRMS.labels("ack")
CONFIRMS_NACK = CONFIRMS.labels("nack")
CONFIRMS_COMMIT_FAILED = CONFIRMS.labels("commit-failed")
CONFIRM_LATENCY = _histogram(
    "twinmq_confirm_latency_seconds",
    "From the end of a publish to its confirm (one observation per confirm frame)",
    (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
FSYNC_LATENCY = _histogram(
    "twinmq_journal_fsync_seconds",
    "Journal write+fdatasync latency per group commit",
    (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
)
COMMIT_BATCH = _histogram(
    "twinmq_journal_batch_ops",
    "Journal operations per group commit",
    (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
)
TOPOLOGY_GROUP = _histogram(
    "twinmq_topology_group_changes",
    "Topology changes (declares, binds, unbinds, deletes) per definitions-log group commit",
    (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
)
ALARM = Gauge("twinmq_alarm", "1 while a resource alarm blocks publishers", ["resource"])
PROTOCOL_ERRORS = Counter(
    "twinmq_protocol_errors", "Channels or connections closed by errors", ["code"]
)
AUTH_FAILURES = Counter("twinmq_auth_failures", "Refused logins")
CONNECTIONS_REFUSED = Counter(
    "twinmq_connections_refused",
    "Client connections refused by a limit (total: closed at once; per-user: 530 at open)",
    ["limit"],
)
EPOCH = Gauge("twinmq_epoch", "Highest epoch this broker has seen")
ROLE = Gauge("twinmq_role_active", "1 while this broker is active, 0 while passive")
REPLICATION_CONNECTED = Gauge("twinmq_replication_link_up", "1 while the replication link is up")
REPLICATION_READY = Gauge(
    "twinmq_replication_ready", "Passive: 1 once caught up (promotable without loss)"
)
REPLICATION_DEGRADED = Gauge(
    "twinmq_replication_degraded", "Active: 1 while confirming without a passive in sync"
)
REPLICATION_REFUSED = Counter(
    "twinmq_replication_refused",
    "Replication connections closed before or at authentication, by reason (over-cap, "
    "handshake-timeout, protocol-error, bad-proof, unauthenticated-refuse, certificate, "
    "peer: a certificate that does not name --peer)",
    ["reason"],
)
ROLE_REFUSED = Counter(
    "twinmq_role_refused",
    "POST /role requests refused before any change, by reason (peer: a replicate_from "
    "that is not --peer)",
    ["reason"],
)
EPOCH_REFUSED = Counter(
    "twinmq_epoch_refused",
    "Epochs from authenticated peers refused as a jump of more than max_epoch_jump",
)
LEASE_RENEWAL_FAILURES = Counter(
    "twinmq_lease_renewal_failures",
    "Active: renewals of the active role's Lease that failed (API error or timeout)",
)
SELF_FENCINGS = Counter(
    "twinmq_lease_self_fencings", "Active: steps down to passive because the Lease was not kept"
)
REPLICATION_LAG = Gauge("twinmq_replication_lag_messages", "Ops sent but not yet acknowledged")
REPLICATION_LAG_SECONDS = Gauge(
    "twinmq_replication_lag_seconds", "Age of the oldest unacknowledged replicated batch"
)
CATCHUP_IN_PROGRESS = Gauge(
    "twinmq_replication_catchup_in_progress", "Active: 1 while a catch-up streams to a passive"
)
CATCHUP_MESSAGES = Counter(
    "twinmq_replication_catchup_messages_sent", "Active: messages sent in catch-up chunks"
)
CATCHUP_BYTES = Counter(
    "twinmq_replication_catchup_bytes_sent", "Active: bytes of catch-up chunk frames sent"
)
CATCHUP_RECEIVED = Counter(
    "twinmq_replication_catchup_messages_received",
    "Passive: messages received in catch-up chunks",
)
DUPLICATES = _counter(
    "twinmq_messages_deduplicated", "Re-sent messages dropped because their message id was seen"
)
JOURNAL_CORRUPTION = Counter(
    "twinmq_journal_corruption_events",
    "Unreadable stretches of journal segments found at start-up (corruption, not torn tails)",
)
JOURNAL_QUARANTINED = Gauge(
    "twinmq_journal_quarantined_files", "Damaged journal files kept in <data-dir>/quarantine"
)
BROKER_DAMAGED = Gauge(
    "twinmq_broker_damaged",
    "1 while this broker recovered with journal corruption and was not repaired",
)
QUARANTINED = Counter(
    "twinmq_messages_quarantined",
    "Messages whose handling failed and was contained to them (by stage); none was dropped",
    ["stage"],
)
HELD_ASIDE = Gauge(
    "twinmq_messages_held_aside",
    "Quarantined messages set aside in their queue (kept in the journal, retried on restart)",
)
AUDIT_RECORDS = _counter("twinmq_audit_records", "Audit records written and fdatasynced")
AUDIT_WRITES = _counter(
    "twinmq_audit_writes", "Audit writes, each fdatasynced before the confirms it describes"
)
AUDIT_WRITE_FAILURES = _counter(
    "twinmq_audit_write_failures",
    "Failed audit writes (the confirms they describe wait for a retry that succeeds)",
)
AUDIT_FSYNC_LATENCY = _histogram(
    "twinmq_audit_fsync_seconds",
    "Audit write+fdatasync latency per group commit",
    (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
)

REGISTRY.register(HotPathCollector())


class TlsCollector(Collector):
    """Each TLS listener's files as loaded (`broker/tls.py`), read from the listeners at
    scrape time: the same figures `/status` shows under `tls`."""

    def __init__(self) -> None:
        self.source: Callable[[], list[TlsFilesStatus]] = list  # the broker sets it

    def collect(self) -> Iterator[Metric]:
        """Four families, labelled by listener (amqps, admin, replication, mirror)."""
        labels = ["listener"]
        loaded = GaugeMetricFamily(
            "twinmq_tls_loaded_timestamp_seconds",
            "When the listener's TLS files in use were loaded (unix time)", labels=labels,
        )  # fmt: skip
        failing = GaugeMetricFamily(
            "twinmq_tls_load_failing",
            "1 while the listener's TLS files as they are now do not load (the previous "
            "ones stay in use)", labels=labels,
        )  # fmt: skip
        errors = CounterMetricFamily(
            "twinmq_tls_reload_errors", "Reloads of changed TLS files that failed", labels=labels
        )
        expiry = GaugeMetricFamily(
            "twinmq_tls_certificate_expiry_timestamp_seconds",
            "When the listener's certificate in use expires (unix time)", labels=labels,
        )  # fmt: skip
        for files in self.source():
            loaded.add_metric([files.listener], files.loaded_at)
            failing.add_metric([files.listener], 0 if files.load_error is None else 1)
            errors.add_metric([files.listener], files.load_errors)
            expiry.add_metric([files.listener], files.certificate.not_after)
        yield from (loaded, failing, errors, expiry)


TLS = TlsCollector()
REGISTRY.register(TLS)
