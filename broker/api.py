"""The admin API's wire shapes: the one definition the broker serves (`broker/admin.py`)
and every caller reads through the one client (`broker/admin_client.py`)."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from twinmq.broker.names import Role as Role  # re-exported: the API's roles are the broker's

# The `error` of an ErrorBody the client maps to its own exception.
UNAUTHORIZED: Final = "unauthorized"
FORBIDDEN: Final = "forbidden"
STALE_EPOCH: Final = "stale epoch"
BROKER_DAMAGED: Final = "broker damaged"
INVALID_ROLE_REQUEST: Final = "invalid role request"
NOT_THE_PEER: Final = "not the peer"  # 403: replicate_from is not --peer
PEER_UNRESOLVED: Final = "peer unresolved"  # 503: --peer does not resolve now, retry
MIRROR_REFUSED: Final = "mirror switch refused"  # 409: wrong role, stale token, not applied
MIRROR_NOT_DRAINED: Final = "mirror not drained"  # 503: demotion under way, retry the same call
VHOST_REFUSED: Final = "vhost deletion refused"  # 409: `/`, still served, or a passive
VHOST_NOT_FOUND: Final = "vhost not found"  # 404
VHOST_NOT_RECORDED: Final = "vhost deletion not recorded"  # 507: the journal refused it

SwitchRole = Literal["source", "replica"]  # what a switchover makes a site
MirrorRole = Literal["source", "replica", "bidirectional"]
TlsListenerName = Literal["amqps", "admin", "replication", "mirror"]
MirrorLinkState = Literal["disabled", "connecting", "connected", "needs-resync", "fenced"]


class QueueStatus(BaseModel):
    """One queue as `GET /status` reports it."""

    name: str
    vhost: str = Field("/", description="The virtual host the queue belongs to")
    durable: bool
    exclusive: bool
    messages: int = Field(description="Ready messages")
    unacked: int = Field(description="Delivered, not yet acknowledged")
    consumers: int
    bytes: int = Field(description="Bytes of ready message bodies")
    replication: Literal["catching-up", "ready", "unreplicated"] = Field(
        description="Whether the passive holds this queue's messages (durable queues only)"
    )


class CorruptionReport(BaseModel):
    """One unreadable stretch of a journal segment found at start-up (not a torn tail)."""

    segment: str = Field(description="The segment file's name")
    offset: int = Field(description="Byte offset of the unreadable stretch")
    length: int = Field(description="Bytes unreadable (messages in them are lost)")
    reason: str
    detected_at: float = Field(description="Unix time of the start-up that found it")
    quarantined_as: str | None = Field(
        None, description="Where the damaged file was moved (under <data-dir>/quarantine)"
    )


class JournalStatus(BaseModel):
    """The journal's state."""

    segments: int
    bytes: int
    live_messages: int
    durable_batch: int = Field(description="Newest group-commit batch known durable")
    damaged: bool = Field(
        False,
        description="Recovered with corruption and not repaired: may know less than it "
        "confirmed; refuses activation without force, never makes its passive discard",
    )
    damaged_since: float | None = Field(None, description="When the damage was first found")
    healed_by: str | None = Field(
        None, description="The active whose catch-up made this broker whole again"
    )
    corruption: list[CorruptionReport] = Field(
        default_factory=list, description="What was found, until `journal repair` clears it"
    )
    quarantined_files: int = Field(0, description="Files in <data-dir>/quarantine")


class CatchupStatus(BaseModel):
    """Active: the catch-up of the attached passive (running, or the one it finished)."""

    in_progress: bool
    candidates: int = Field(description="Messages in the active's snapshot at the start")
    sent: int = Field(description="Messages sent so far")
    kept: int = Field(description="Messages the passive already had (not sent)")
    discarded: int = Field(description="Messages the passive held and the active does not")
    skipped: int = Field(description="Settled on the active before their turn (not sent)")
    bytes: int = Field(description="Bytes of catch-up chunks written")
    chunks: int = Field(description="Chunks written")
    acked_chunks: int = Field(description="Chunks durable on the passive")
    acked_messages: int = Field(description="Messages in those chunks")
    dedup_keys: int = Field(
        0, description="Keys of the active's duplicate-detection window sent (after the messages)"
    )


class ReplicationStatus(BaseModel):
    """The replication link as this broker sees it."""

    peer: str | None = Field(description="Passive: the active's address; active: the passive")
    link_connected: bool
    link_tls: bool = Field(
        False, description="The link runs over TLS (mutual TLS: `--replication-tls-*`)"
    )
    ready: bool = Field(
        description="Passive: caught up (promotable without loss); active: a passive in sync"
    )
    degraded: bool = Field(description="Active confirming without a passive in sync")
    lag_messages: int = Field(description="Replicated ops not yet on the passive's disk")
    lag_seconds: float = Field(description="Age of the oldest of those")
    lost_at: float | None = Field(None, description="Passive: when the link was last lost")
    caught_up_epoch: int | None = Field(
        None,
        description="Passive: the epoch of the active it caught up with, kept after the "
        "link's loss (None: not caught up); `ready` also needs that active's recent echo",
    )
    epoch_refused: str | None = Field(
        None, description="The last epoch a peer offered that was refused (max_epoch_jump)"
    )
    catchup: CatchupStatus | None = Field(None, description="Active: the passive's catch-up")


class RoleRequest(BaseModel):
    """`POST /role`: become active or passive at an epoch."""

    role: Role
    epoch: int = Field(ge=0)
    replicate_from: str | None = Field(
        None,
        description="host:port of the active's replication listener (passive only)",
        pattern=r"^[^:\s]+:\d{1,5}$",
    )
    force: bool = Field(
        False,
        description="Activate a damaged broker (journal corruption) anyway; it then never "
        "tells its passive to discard messages it lacks",
    )


class DemotionToken(BaseModel):
    """What a demoted source hands to its mirror: promote only once applied up to `seq`."""

    origin: str = Field(description="The demoted site's origin id (--mirror-id)")
    seq: int = Field(ge=0, description="Its last event: the mirror must have applied it")
    epoch: int = Field(ge=1, description="The DR epoch the promoted site takes (fencing)")


class MirrorDemoteRequest(BaseModel):
    """`POST /mirror/demote` on the source."""

    timeout: float = Field(
        30.0, gt=0, le=3600, description="Seconds to wait for the replication queue to drain"
    )


class MirrorPromoteRequest(BaseModel):
    """`POST /mirror/promote` on a replica: with the source's token (switchover) or, the
    source being gone, with `force` (failover, with the RPO reported)."""

    token: DemotionToken | None = None
    force: bool = Field(False, description="Promote without a token: the source site is gone")
    timeout: float = Field(
        30.0, gt=0, le=3600, description="Seconds to wait for the token's last event to apply"
    )


class MirrorRpo(BaseModel):
    """What a forced promotion knows it may have lost: never hidden."""

    last_applied_seq: int = Field(description="The last event of the old source applied here")
    source_last_seq_seen: int = Field(description="The source's newest event, as last seen")
    source_unreplicated_seen: int = Field(
        description="Events the source had not had acknowledged, as last seen"
    )
    seen_at: float | None = Field(description="When the source last reported (unix time)")


class MirrorUnmirrored(BaseModel):
    """On an old source reversed after a forced failover: what it journaled and the
    promoted site never applied (the RPO as a count, known once this site is back)."""

    promoted: str = Field(description="The site that took over (the mirror id it announced)")
    applied_seq: int = Field(description="This site's last event the promoted site applied")
    events: int = Field(description="This site's events after it: never applied there")
    messages: int = Field(
        description="Messages those events enqueued: lost to the promoted site (kept here "
        "in the orphan queue unless settled since)"
    )
    settles: int = Field(description="Settles (acks, expiries...) in them, never seen there")
    counted_at: float = Field(description="When this site counted them (unix time)")
    unverified_events: int = Field(
        0,
        description="Events up to `applied_seq` with a message the promoted site's seed "
        "did not show it holds: kept in this site's backlog, not dropped on its word",
    )
    unverified_messages: int = Field(0, description="Those messages (kept here as well)")
    epoch: int = Field(0, description="This site's DR epoch when it counted (once per fence)")


class MirrorSwitch(BaseModel):
    """The answer of `POST /mirror/demote` and `POST /mirror/promote` (replayed as-is)."""

    role: SwitchRole = Field(description="This site's DR role now")
    epoch: int = Field(description="This site's DR epoch now")
    token: DemotionToken | None = Field(None, description="Demote: hand it to the mirror")
    forced: bool = False
    rpo: MirrorRpo | None = Field(None, description="Forced promotion: what may be lost")
    seconds: float = Field(description="Time the switch took here")
    seed_pending: str | None = Field(
        None,
        description="Forced promotion: why its seed for the old source is not durable yet "
        "(clients refused until it is); None once it is",
    )


class MirrorReseed(BaseModel):
    """The answer of `POST /mirror/reseed`: the seed queued for the mirror."""

    messages: int = Field(description="Messages the seed's snapshot carries")
    events: int = Field(description="Events now in the replication queue (the seed's included)")
    reason: str = Field(description="Why, as logged and sent to the mirror")


class VhostDeleted(BaseModel):
    """The answer of `DELETE /vhosts/{name}`: a retired vhost's content, deleted."""

    name: str
    queues: int = Field(description="Queues deleted (durable ones with their messages)")
    exchanges: int = Field(description="Exchanges deleted (its own `amq.*` set not counted)")
    messages: int = Field(description="Ready messages deleted with the queues")
    connections: int = Field(description="Connections still open to it, closed (320)")


class VhostStatus(BaseModel):
    """One virtual host as `GET /status` reports it."""

    name: str
    served: bool = Field(
        description="Declared by the users file: clients may open it (else retired: "
        "connections refused, content kept)"
    )
    queues: int
    mirrored: bool = Field(
        description="The DR mirror carries its changes (every vhost, in every mode: one-way, "
        "bidirectional, full mesh)"
    )
    federated: bool = Field(
        description="Federation serves it: links from the federation file may federate its "
        "exchanges, downstreams may link into it, its state is on its amq.twinmq.state (every "
        "vhost since federation in vhosts)"
    )


class MirrorTargetStatus(BaseModel):
    """One target of a full-mesh site (several --mirror-to): its link and its cursor."""

    target: str = Field(description="The target's address, as configured")
    peer: str | None = Field(None, description="Its mirror id, as its last handshake said")
    state: MirrorLinkState = Field(description="This target's link, honestly")
    connected: bool = Field(False, description="A heartbeat came back over this link")
    acked_seq: int = Field(0, description="The newest event it acknowledged (its cursor)")
    queue_events: int = Field(0, description="Events of this site it has not acknowledged")
    queue_bytes: int = Field(0, description="Their bytes")
    oldest_event_age_seconds: float = Field(0.0, description="Age of the oldest of them")
    round_trip_seconds: float | None = Field(None, description="The last heartbeat's")
    link_error: str | None = Field(None, description="Why its link's last attempt failed")
    mirror_blocked: str | None = Field(
        None, description="Its resource alarm (disk, memory): it applies nothing now"
    )
    needs_resync: str | None = Field(
        None, description="Past the retention bound: its backlog dropped, re-seed it"
    )


class MirrorStatus(BaseModel):
    """The DR mirror as this broker sees it: its source side, its mirror side, or both."""

    enabled: bool = Field(
        description="This broker mirrors its changes now (--mirror-to, and the DR source)"
    )
    role: MirrorRole | None = Field(None, description="This site's DR role (None: no mirror)")
    epoch: int = Field(0, description="This site's DR epoch (fencing: the highest wins)")
    state: MirrorLinkState = Field("disabled", description="The source's link, honestly")
    connected: bool = Field(False, description="A heartbeat came back over the link")
    heartbeat_age_seconds: float | None = Field(
        None, description="Since the last heartbeat round trip completed"
    )
    round_trip_seconds: float | None = Field(None, description="The last heartbeat's")
    link_error: str | None = Field(None, description="Why the link's last attempt failed")
    mirror_blocked: str | None = Field(
        None, description="The mirror's resource alarm (disk, memory): it applies nothing now"
    )
    queue_lag_events: dict[str, int] = Field(
        default_factory=dict, description="Per queue: events touching it not yet acknowledged"
    )
    queue_lag_seconds: dict[str, float] = Field(
        default_factory=dict, description="Per queue: age of its oldest unacknowledged event"
    )
    queue_lag_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Per queue: bytes of its ops (messages, settles) in those events",
    )
    needs_resync: str | None = Field(
        None, description="Why the backlog was dropped (retention bound): re-seed the mirror"
    )
    last_seed: str | None = Field(
        None, description="Why the last seed was queued for the mirror (since start-up)"
    )
    seed_pending: str | None = Field(
        None,
        description="A forced promotion's seed not durable yet (a full disk): why; clients "
        "are refused until it is",
    )
    orphans: int = Field(
        0, description="On a mirror: messages in amq.twinmq.mirror-orphans (kept, not lost)"
    )
    rpo: MirrorRpo | None = Field(None, description="Set by a forced promotion, kept")
    failover_rpo: MirrorRpo | None = Field(
        None, description="On a replica: what a forced promotion would report now"
    )
    unmirrored: MirrorUnmirrored | None = Field(
        None,
        description="On an old source reversed after a forced failover: its events the "
        "promoted site never applied (the RPO, counted), kept",
    )
    target: str | None = Field(
        None, description="The mirror's address (a mesh: the addresses, comma-separated)"
    )
    mesh: bool = Field(
        False, description="A full-mesh member (bidirectional with several --mirror-to)"
    )
    targets: list[MirrorTargetStatus] = Field(
        default_factory=list, description="A mesh: each target's link and cursor"
    )
    queue_events: int = Field(0, description="Events not yet acknowledged by the mirror")
    queue_bytes: int = Field(0, description="Their bytes")
    oldest_event_age_seconds: float = Field(0.0, description="Age of the oldest of them")
    tls: bool = Field(False, description="The link runs mutual TLS (--mirror-tls-*)")
    flow_control: bool = Field(False, description="Publishers blocked for the mirror's lag")
    listening: bool = Field(False, description="This broker accepts mirror links (--mirror-port)")
    sources_connected: int = Field(0, description="Sources linked to this mirror now")
    held_acks: int = Field(0, description="Settles held for messages not (yet) here")


class PeerStateStatus(BaseModel):
    """A peer's definitions as a link holds them (from its `amq.twinmq.state`)."""

    server_id: str | None = Field(None, description="The peer that sent them")
    epoch: int = Field(0, description="The peer's epoch")
    seq: int = Field(0, description="The peer's change counter, as of the last message applied")
    exchanges: int = 0
    queues: int = 0
    bindings: int = 0
    link_queue_bindings: list[str] = Field(
        default_factory=list,
        description="Routing keys the link's own queue is bound with there, as the peer says",
    )


class FederationLinkStatus(BaseModel):
    """One federated exchange's link to its upstream (docs/federation.md)."""

    exchange: str = Field(description="The local (downstream) exchange")
    vhost: str = Field("/", description="The local exchange's vhost")
    upstream_vhost: str = Field("/", description="The vhost the link opens on the upstream")
    upstream: str = Field(description="The upstream's name in the federation file")
    uri: str = Field(description="The upstream's URI (never a password)")
    upstream_exchange: str
    upstream_server_id: str | None = Field(None, description="As the upstream announced it")
    queue: str = Field(description="The link's queue on the upstream")
    state: Literal["connecting", "running", "refused"] = Field(
        description="running only after a verified round trip; refused: a duplicate "
        "server identifier"
    )
    error: str | None = Field(None, description="Why the link is not running")
    running_since: float | None = None
    reconnect_pause: float | None = Field(
        None,
        description="While waiting to reconnect: this pause (s), doubled per failed "
        "attempt up to reconnect-max-seconds, back to 1 s after a session that ran",
    )
    bindings: int = Field(0, description="Normalised bindings held on the upstream queue")
    local_bindings: int = Field(0, description="Bindings on the local exchange they stand for")
    messages_received: int = Field(0, description="Republished here (since start)")
    duplicates_dropped: int = Field(0, description="Dropped: (origin, seq) seen already")
    loops_dropped: int = Field(0, description="Dropped: this server on their path, or max-hops")
    messages_held: int = Field(
        0, description="Kept as received in amq.twinmq.federation-held: not republishable here"
    )
    dedup_keys: int = Field(0, description="Keys in the server's durable dedup window")
    forward: bool = Field(False, description="Whether local publishes are forwarded upstream")
    messages_forwarded: int = Field(0, description="Forwarded and confirmed upstream (since start)")
    forward_pending: int = Field(
        0, description="In the outbox: not yet forwarded, or not yet confirmed upstream"
    )
    forward_loops_dropped: int = Field(
        0, description="Not forwarded: the upstream already on their path, or past max-hops"
    )
    upstream_state: PeerStateStatus | None = Field(
        None, description="The upstream's definitions (state replication; None: not subscribed)"
    )
    stale_unbound: int = Field(
        0,
        description="Upstream bindings of the link's queue removed at a resync because the "
        "upstream's state showed them and nothing here wants them (not in the local record)",
    )


class FederationBinding(BaseModel):
    """A binding of a federation queue held here for a downstream (the upstream's view)."""

    exchange: str
    routing_key: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class StateReplicationStatus(BaseModel):
    """`amq.twinmq.state`: this server's definitions published to subscribers."""

    seq: int = Field(description="Change counter: the last `changes` message's seq")
    subscribers: int = Field(description="Queues bound to amq.twinmq.state now")
    full_states_sent: int = Field(description="Full states sent to new subscribers (since start)")
    changes_published: int = Field(description="`changes` messages published (since start)")
    exchanges: int = Field(description="Exchanges in the state (built-in ones left out)")
    queues: int = Field(description="Queues in the state (internal amq.twinmq.* left out)")
    bindings: int = Field(description="Bindings in the state")


class FederationStatus(BaseModel):
    """Federation as this broker sees it: as a downstream (links) and as an upstream."""

    server_id: str
    links: list[FederationLinkStatus] = Field(default_factory=list)
    refused_peers: list[str] = Field(
        default_factory=list, description="The last peers refused for a duplicate identifier"
    )
    federation_queues: dict[str, list[FederationBinding]] = Field(
        default_factory=dict,
        description="Queues of downstream links held here (federation:...) and their bindings",
    )
    vhost_federation_queues: dict[str, dict[str, list[FederationBinding]]] = Field(
        default_factory=dict,
        description="The same in the other vhosts than /: vhost -> queue -> bindings (links "
        "of downstreams that opened that vhost)",
    )
    forwarded_received: int = Field(
        0, description="Messages downstreams forwarded here, published here (since start)"
    )
    forwarded_dropped: int = Field(
        0, description="Messages downstreams forwarded here, dropped as duplicates or loops"
    )
    peer_status_received: int = Field(
        0, description="Status messages downstream links sent to this server's amq.peer"
    )
    peer_status_dropped: int = Field(
        0,
        description="Status messages of downstream links not published on amq.peer (the "
        "link's user may not write there, or persistent)",
    )
    global_keys_bound: int = Field(
        0, description="Temporary queues bound to global-keys exchanges automatically"
    )
    reply_to_rewritten: int = Field(
        0, description="Published messages whose reply-to was made a global key"
    )
    state: StateReplicationStatus | None = Field(
        None, description="State replication (amq.twinmq.state)"
    )
    upstream_queues_deleted: list[str] = Field(
        default_factory=list,
        description="upstream/queue: link queues of exchanges no longer federated, deleted "
        "on their upstream (since start)",
    )
    upstream_queues_pending: list[str] = Field(
        default_factory=list,
        description="upstream/queue: link queues of exchanges no longer federated, to be "
        "deleted on their upstream (it is not reachable yet)",
    )
    upstream_queues_found: list[str] = Field(
        default_factory=list,
        description="upstream/queue: link queues named for this server in an upstream's "
        "state (amq.twinmq.state) that no configured link uses and no record here named "
        "(a wiped data dir): orphans, deleted as the others (since start)",
    )
    upstream_queues_left: list[str] = Field(
        default_factory=list,
        description="upstream/queue: link queues of an upstream removed from the federation "
        "file, not deleted (no address nor credentials: delete them by hand)",
    )


class TlsCertificateStatus(BaseModel):
    """A certificate a listener presents, as loaded (what a CA rotation checks)."""

    fingerprint: str = Field(description="SHA-256 of the certificate (DER), lowercase hex")
    serial: str = Field(description="Its serial number, lowercase hex")
    issuer: str = Field(description="Its issuer's name (RFC 4514)")
    authority_key_id: str | None = Field(
        None,
        description="The key identifier of the CA that signed it (lowercase hex; its "
        "Authority Key Identifier): tells two CAs of one name apart",
    )
    not_after: float = Field(description="When it expires (unix time)")


class TlsFilesStatus(BaseModel):
    """One listener's TLS files as the broker loaded them (it reloads them when they change,
    `broker/tls.py`): what new handshakes use now."""

    listener: TlsListenerName
    cert_file: str
    certificate: TlsCertificateStatus
    ca_file: str | None = Field(None, description="The trust bundle (peers' certificates)")
    ca_fingerprints: list[str] = Field(
        default_factory=list,
        description="SHA-256 (DER, lowercase hex) of each CA certificate in the trust "
        "bundle, in the file's order",
    )
    loaded_at: float = Field(description="When these files were loaded (unix time)")
    reloads: int = Field(0, description="Successful reloads since start-up")
    load_errors: int = Field(0, description="Reloads that failed since start-up")
    load_error: str | None = Field(
        None,
        description="Why the files as they are now do not load (the last attempt failed): "
        "the certificate and bundle above are still in use; cleared by the next good load",
    )
    load_error_at: float | None = Field(None, description="When that attempt was made")


class BrokerStatus(BaseModel):
    """`GET /status`."""

    name: str
    version: str
    role: Role
    epoch: int
    ready: bool = Field(description="Serving clients (active), or promotable without loss")
    uptime_seconds: float
    connections: int
    channels: int
    alarms: list[str]
    queues: list[QueueStatus]
    vhosts: list[VhostStatus] = Field(default_factory=list)
    journal: JournalStatus
    replication: ReplicationStatus
    mirror: MirrorStatus | None = None
    server_id: str = Field("", description="This server's identifier (--server-id)")
    federation: FederationStatus | None = None
    tls: list[TlsFilesStatus] = Field(
        default_factory=list,
        description="Each TLS listener's files as loaded now (the operator's CA rotation "
        "waits for every pod to load each phase's)",
    )


class Readiness(BaseModel):
    """`GET /readyz` (HTTP 200 when ready, 503 when not)."""

    ready: bool
    reason: str | None = Field(None, description="Why clients are refused right now")


class ErrorBody(BaseModel):
    """Body of every admin API error."""

    error: str
    detail: str = ""
