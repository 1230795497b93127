"""Prometheus metrics of the broker (one registry per process, the default one)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

CONNECTIONS = Gauge("twinmq_connections", "Open client connections")
CHANNELS = Gauge("twinmq_channels", "Open channels")
QUEUES = Gauge("twinmq_queues", "Declared queues")
QUEUE_MESSAGES = Gauge("twinmq_queue_messages_ready", "Ready messages per queue", ["queue"])
QUEUE_UNACKED = Gauge(
    "twinmq_queue_messages_unacknowledged",
    "Delivered, unacknowledged messages per queue",
    ["queue"],
)
PUBLISHED = Counter("twinmq_messages_published", "Messages routed to at least one queue or dropped")
UNROUTABLE = Counter("twinmq_messages_unroutable", "Published messages no queue took")
DELIVERED = Counter("twinmq_messages_delivered", "Deliveries to consumers and basic.get")
ACKED = Counter("twinmq_messages_acknowledged", "Deliveries acknowledged by consumers")
REDELIVERED = Counter("twinmq_messages_requeued", "Deliveries returned to their queue")
EXPIRED = Counter("twinmq_messages_expired", "Messages dropped by TTL")
DEAD_LETTERED = Counter("twinmq_messages_dead_lettered", "Messages sent to a dead-letter exchange")
CONFIRMS = Counter("twinmq_confirms", "Publisher confirms sent", ["outcome"])
CONFIRM_LATENCY = Histogram(
    "twinmq_confirm_latency_seconds",
    "From the end of a publish to its confirm (one observation per confirm frame)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
FSYNC_LATENCY = Histogram(
    "twinmq_journal_fsync_seconds",
    "Journal write+fdatasync latency per group commit",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
)
COMMIT_BATCH = Histogram(
    "twinmq_journal_batch_ops",
    "Journal operations per group commit",
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
)
ALARM = Gauge("twinmq_alarm", "1 while a resource alarm blocks publishers", ["resource"])
PROTOCOL_ERRORS = Counter(
    "twinmq_protocol_errors", "Channels or connections closed by errors", ["code"]
)
AUTH_FAILURES = Counter("twinmq_auth_failures", "Refused logins")
EPOCH = Gauge("twinmq_epoch", "Highest epoch this broker has seen")
ROLE = Gauge("twinmq_role_active", "1 while this broker is active, 0 while passive")
REPLICATION_CONNECTED = Gauge("twinmq_replication_link_up", "1 while the replication link is up")
REPLICATION_READY = Gauge(
    "twinmq_replication_ready", "Passive: 1 once caught up (promotable without loss)"
)
REPLICATION_DEGRADED = Gauge(
    "twinmq_replication_degraded", "Active: 1 while confirming without a passive in sync"
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
DUPLICATES = Counter(
    "twinmq_messages_deduplicated", "Re-sent messages dropped because their message id was seen"
)
