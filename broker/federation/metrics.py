"""Prometheus metrics of federation, per link (label `link`: the local exchange)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

LINK_RUNNING = Gauge(
    "twinmq_federation_link_running",
    "1 once the link completed a verified round trip with its upstream (declare-ok, "
    "bindings synchronised, consume-ok), 0 while connecting or refused",
    ["link"],
)
LINK_REFUSED = Gauge(
    "twinmq_federation_link_refused",
    "1 while the link is refused (a duplicate server identifier)",
    ["link"],
)
BINDINGS = Gauge(
    "twinmq_federation_bindings",
    "Normalised bindings the link holds on its upstream queue",
    ["link"],
)
RECEIVED = Counter(
    "twinmq_federation_messages_received_total",
    "Messages received from the upstream and republished here",
    ["link"],
)
DUPLICATES = Counter(
    "twinmq_federation_duplicates_dropped_total",
    "Deliveries dropped as duplicates (their (origin, seq) was already republished)",
    ["link"],
)
LOOPS = Counter(
    "twinmq_federation_loops_dropped_total",
    "Deliveries dropped because this server is on their path or they passed max-hops",
    ["link"],
)
RECONNECTS = Counter(
    "twinmq_federation_connects_total", "Connection attempts to the upstream", ["link"]
)
PEERS_REFUSED = Counter(
    "twinmq_federation_peers_refused_total",
    "Federation peers refused here because they announced this server's identifier",
)
HELD = Counter(
    "twinmq_federation_held_total",
    "Deliveries kept as received in amq.twinmq.federation-held because they could not be "
    "republished here (past this server's header bounds once the path is added)",
    ["link"],
)
FORWARDED = Counter(
    "twinmq_federation_messages_forwarded_total",
    "Messages published here and forwarded to the upstream (confirmed there)",
    ["link"],
)
FORWARDED_RECEIVED = Counter(
    "twinmq_federation_forwarded_received_total",
    "Messages forwarded here by downstreams and published here (upstream side)",
)
FORWARDED_DUPLICATES = Counter(
    "twinmq_federation_forwarded_duplicates_total",
    "Messages forwarded here by downstreams and dropped as duplicates or loops (upstream side)",
)
DEDUP_FORCED = Counter(
    "twinmq_federation_dedup_forced_total",
    "Dedup keys forgotten at the window's bound (a span of 10,000 times dedup-window seqs)"
    " while a link of this server had not passed them yet: a copy that link brings later is"
    " delivered again",
)
