"""Prometheus metrics of the mirror (both ends); gauges read their objects at scrape time."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ENABLED = Gauge("twinmq_mirror_enabled", "1 if this broker mirrors to a DR site (--mirror-to)")
CONNECTED = Gauge(
    "twinmq_mirror_connected", "1 once the mirror link has completed a verified round trip"
)
QUEUE_EVENTS = Gauge("twinmq_mirror_queue_events", "Events not yet acknowledged by the mirror")
QUEUE_BYTES = Gauge("twinmq_mirror_queue_bytes", "Bytes of events not yet acknowledged")
OLDEST_AGE = Gauge(
    "twinmq_mirror_oldest_event_age_seconds", "Age of the oldest unacknowledged event"
)
FLOW_CONTROL = Gauge(
    "twinmq_mirror_flow_control",
    "1 while publishers are blocked because the connected mirror lags past --mirror-max-lag",
)
SENT = Counter("twinmq_mirror_sent_events_total", "Events sent to the mirror (re-sends included)")
SENT_BYTES = Counter(
    "twinmq_mirror_sent_bytes_total",
    "Bytes of the events sent to the mirror, as sent (a seed's snapshot as its delta)",
)
RECONCILE_BYTES = Counter(
    "twinmq_mirror_reconcile_bytes_total",
    "On the source: bytes of the RECONCILE frames that compared a seed with the mirror (both ways)",
)
RECONCILE_REFUSED = Counter(
    "twinmq_mirror_reconcile_refused_total",
    "On the mirror: source links refused for their RECONCILE (beyond the bounds of one "
    "frame, malformed, after the session's first event, or marks above anything this "
    "site made); the reason is in the log and in the source's link error",
)
SEED_SKIPPED = Counter(
    "twinmq_mirror_seed_skipped_messages_total",
    "On the source: messages of a seed the mirror held already, so not sent (the delta)",
)
APPLIED = Counter("twinmq_mirror_applied_events_total", "Events applied on this mirror")
LAST_APPLIED_AGE = Gauge(
    "twinmq_mirror_last_applied_event_age_seconds",
    "On the mirror: seconds between the last applied event's creation and now (per link)",
)
DEAD_LETTERED = Counter(
    "twinmq_mirror_dead_lettered_total", "Events put in the mirror DLQ after their retries"
)
HELD_ACKS = Gauge("twinmq_mirror_held_acks", "Settles held for messages not (yet) on the mirror")
HELD_APPLIED = Counter(
    "twinmq_mirror_held_applied_total", "Messages settled on arrival by a held settle"
)
ROLE = Gauge("twinmq_mirror_role_source", "1 while this site is the DR source (writable)")
EPOCH = Gauge("twinmq_mirror_epoch", "This site's DR epoch (fencing)")
QUEUE_LAG = Gauge(
    "twinmq_mirror_queue_lag_events",
    "Per queue: events touching it not yet acknowledged by the mirror",
    ["queue"],
)
NEEDS_RESYNC = Gauge(
    "twinmq_mirror_needs_resync",
    "1 once the replication queue passed its retention bound and its backlog was dropped",
)
ROUND_TRIP = Gauge(
    "twinmq_mirror_heartbeat_round_trip_seconds", "The last heartbeat's round trip on the link"
)
SEEDS = Counter(
    "twinmq_mirror_seeds_total",
    "Seeds: on the source, seeds queued (first activation, re-seeds); on the mirror, applied",
)
ORPHANED = Counter(
    "twinmq_mirror_orphaned_total",
    "On the mirror: messages a snapshot showed the source lacks, moved to the orphan queue",
)
QUEUE_LAG_SECONDS = Gauge(
    "twinmq_mirror_queue_lag_seconds",
    "Per queue: age of its oldest event not yet acknowledged by the mirror",
    ["queue"],
)
QUEUE_LAG_BYTES = Gauge(
    "twinmq_mirror_queue_lag_bytes",
    "Per queue: bytes of its ops in the events not yet acknowledged by the mirror",
    ["queue"],
)
EVENT_LAG = Histogram(
    "twinmq_mirror_event_lag_seconds",
    "On the source: from an event's creation to the mirror's acknowledgement of it",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
FORWARDED = Counter(
    "twinmq_mirror_forwarded_events_total",
    "Bidirectional mode: events applied here and passed on to this site's mirror",
)
LOOPED = Counter(
    "twinmq_mirror_looped_events_total",
    "Bidirectional mode: events that came back to their origin or to a site they went "
    "through, or arrived twice by another path: counted as applied, never applied again",
)
REFUSED = Counter(
    "twinmq_mirror_refused",
    "Mirror links refused by mutual TLS (--mirror-tls-*): certificate (the TLS handshake "
    "failed: the peer's certificate did not verify against --mirror-tls-ca or was missing, "
    "or the peer spoke no TLS), identity (a source's certificate does not name the origin "
    "it claims)",
    ["reason"],
)

# A full mesh (several --mirror-to): per target.
TARGET_CONNECTED = Gauge(
    "twinmq_mirror_target_connected",
    "1 while the link to this mesh target is connected (a heartbeat came back)",
    ["target"],
)
TARGET_QUEUE_EVENTS = Gauge(
    "twinmq_mirror_target_queue_events",
    "Events of this site not yet acknowledged by this mesh target",
    ["target"],
)
TARGET_OLDEST_AGE = Gauge(
    "twinmq_mirror_target_oldest_event_age_seconds",
    "Age of the oldest event this mesh target has not acknowledged (0: none)",
    ["target"],
)
TARGET_NEEDS_RESYNC = Gauge(
    "twinmq_mirror_target_needs_resync",
    "1 while this mesh target is past the retention bound (its backlog dropped)",
    ["target"],
)
