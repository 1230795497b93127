"""The BrokerCluster API (`twinmq.io/v1alpha1`): spec and status as pydantic models.

These models are the one definition of the resource: the CRD's schema in
`crds/` is generated from them (`python -m twinmq.operator.crd`), CEL rules
included, and a test keeps the committed YAML equal to the generated one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from twinmq.broker.names import MIRROR_PORT

GROUP = "twinmq.io"
VERSION = "v1alpha1"
KIND = "BrokerCluster"
PLURAL = "brokerclusters"

BrokerName = Literal["primary", "backup"]
DEFAULT_IMAGE = "twinmq/twinmq:0.1.0"


def iso(moment: datetime) -> str:
    """A status timestamp (RFC 3339, UTC, seconds) of an aware datetime."""
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(value: str) -> datetime:
    """A Kubernetes timestamp (status, metadata, Lease) as an aware datetime."""
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def cel(rule: str, message: str) -> dict[str, Any]:
    """A CEL validation rule for the schema (`x-kubernetes-validations`)."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Storage(ApiModel):
    """Each broker's PersistentVolumeClaim (its size may grow, never shrink)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "quantity(self.size).compareTo(quantity(oldSelf.size)) >= 0",
            "storage.size cannot shrink (a PersistentVolumeClaim can only grow)",
        )
    )

    size: str = Field(
        "1Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$", max_length=32,
        description="Requested volume size (a Kubernetes quantity)",
    )  # fmt: skip
    storage_class_name: str | None = Field(None, description="StorageClass; the default if unset")


DATE_TIME: dict[str, Any] = {"format": "date-time"}
"""Schema of a status timestamp (RFC 3339), so clients read it as a time."""


class UpdateStrategy(ApiModel):
    """How a pod template change reaches the pods: the passive first, then the active."""

    method: Literal["Switchover", "RestartInPlace"] = Field(
        "Switchover",
        description="Switchover: a controlled switchover to the updated passive (the active "
        "demoted first), then the old active is updated and comes back passive. "
        "RestartInPlace: the active's pod is recreated without a switchover; the updated "
        "passive takes over by automatic failover, as after a crash",
    )
    active_update: Literal["Unsupervised", "Supervised"] = Field(
        "Unsupervised",
        description="Supervised: once the passive is updated and ready, wait for a manual "
        "promote (kubectl twinmq promote) before the active is updated",
    )
    ready_timeout_seconds: int = Field(
        600, ge=30, le=86400,
        description="An updated broker not ready (caught up) within this long stops the "
        "rollout (condition Stalled); the other broker stays active",
    )  # fmt: skip


class Resources(ApiModel):
    """Container resources of each broker (Kubernetes ResourceRequirements)."""

    requests: dict[str, str] = Field(
        default_factory=lambda: {"cpu": "250m", "memory": "256Mi"}, description="Requests"
    )
    limits: dict[str, str] = Field(default_factory=dict, description="Limits")


class Auth(ApiModel):
    """Credentials of the brokers' users, admin API and replication link."""

    secret_name: str | None = Field(
        None,
        description="Secret with keys `users.json`, `admin-token`, `replication-token` and, "
        "optionally, `metrics-token` (read-only admin token, for monitoring); generated "
        "(named <cluster>-auth) when unset",
    )


class MirrorTarget(ApiModel):
    """Where the source site's active reaches the mirror site's active broker."""

    host: str = Field(
        min_length=1,
        max_length=253,
        description="The mirror BrokerCluster's virtual-IP Service as seen from here "
        "(`<name>.<namespace>.svc`, or an address of the other site)",
    )
    port: int = Field(MIRROR_PORT, ge=1, le=65535, description="Its mirror port")


class MirrorTls(ApiModel):
    """Mutual TLS on the mirror link, in addition to its token (docs/mirror.md, "Mutual TLS
    on the link"). Each site presents a mirror certificate its own CA issued
    (`<cluster>-mirror-tls`: named for the site, `<namespace>/<name>`, and for its
    virtual-IP Service) and verifies the other site's against that site's CA (its
    `<cluster>-ca` ConfigMap, as CloudNativePG's replica clusters take their source's
    `sslRootCert`): copied by the operator when `target.host` names a BrokerCluster here
    that names this site back (`operator/peerca.py`), else from `caConfigMap`."""

    enabled: bool = Field(
        True,
        description="Run the link over mutual TLS once the other site's CA is known: copied "
        "by the operator (`<cluster>-mirror-peer-ca`) when `target.host` is the Service of a "
        "BrokerCluster it can read that names this site as its target, else `caConfigMap` "
        "(needs `spec.tls` on, with the operator's CA or `issuerRef`; the `MirrorTls` "
        "condition says which, or why the link is plaintext)",
    )
    ca_config_map: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="ConfigMap in this namespace holding the other site's CA certificate "
        "(a copy of its `<cluster>-ca`; in a ring of three, both other sites' CAs in one "
        "bundle; `kubectl twinmq mirror trust` writes one from another cluster's context). "
        "Wins over the operator's copy. Unset, with no copy: the link stays plaintext "
        "(token only)",
    )
    ca_key: str = Field("ca.crt", min_length=1, max_length=253, description="Its key")
    server_names: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="More names for this site's mirror certificate: the addresses the other "
        "site dials to reach this one, when not this cluster's virtual-IP Service",
    )
    server_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="The name this site checks the target's certificate for (default: "
        "`target.host`; give the target's virtual-IP Service name when `host` is an address)",
    )


MirrorRoleName = Literal["source", "replica", "bidirectional"]
MESH_MAX_TARGETS = 16
"""The most targets a mesh site names (bounds the CEL uniqueness rule's cost)."""


class Mirror(ApiModel):
    """This BrokerCluster's half of a DR mirror (docs/mirror.md): a source mirrors every
    durable change to its target; a replica applies them and is read-only for clients; a
    bidirectional site does both at once and stays writable (two sites naming each other,
    or a ring of three, each naming the next)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.role == 'replica' || has(self.target) || has(self.targets)",
                    "message": "a mirror source or bidirectional site names its target "
                    "(or, a full mesh, its targets)",
                },
                {
                    "rule": "!(has(self.target) && has(self.targets))",
                    "message": "spec.mirror names one target or a mesh's targets, not both",
                },
                {
                    # The broker sends a one-way source's events, and hands its switchover
                    # token, to one mirror: several targets are a bidirectional mesh's.
                    "rule": "!has(self.targets) || self.role == 'bidirectional'",
                    "message": "spec.mirror.targets (a full mesh) needs role bidirectional",
                },
                {
                    "rule": "!has(self.targets) || size(self.targets) >= 2",
                    "message": "spec.mirror.targets names the mesh's other sites: at least "
                    "two (one other site: spec.mirror.target)",
                },
                {
                    # Each target is one link with one journaled cursor on the broker: the
                    # same site twice would be mirrored to twice.
                    "rule": "!has(self.targets) || self.targets.all(t, "
                    "self.targets.exists_one(u, u.host == t.host && u.port == t.port))",
                    "message": "spec.mirror.targets must be unique (host and port)",
                },
                {
                    # The broker checks one --mirror-tls-server-name on every link: in a
                    # mesh each target's certificate is checked for its own host.
                    "rule": "!has(self.targets) || !has(self.tls) || !has(self.tls.serverName)",
                    "message": "spec.mirror.tls.serverName would be checked on every target "
                    "of a mesh: name each target's Service in targets[].host instead",
                },
                {
                    # The broker keeps its first role in its journal (a switchover changes
                    # it there) and a bidirectional site keeps an id map a one-way site has
                    # not: editing the spec could not turn a running site into the other
                    # mode, so the change is refused rather than silently ignored.
                    "rule": "(self.role == 'bidirectional') == (oldSelf.role == 'bidirectional')",
                    "message": "spec.mirror.role cannot change to or from bidirectional "
                    "(delete the mirror, or the cluster, and declare it again)",
                },
            ]
        }
    )

    role: MirrorRoleName = Field(
        description="source: writable, mirrors to `target`; replica: applies what a source "
        "sends (clients may read, not publish); bidirectional: both at once, writable, "
        "mirrors its own and the applied changes to `target` (no DR switchover)"
    )
    target: MirrorTarget | None = Field(
        None,
        description="The other site: a source or bidirectional site mirrors to it (in a ring "
        "of three, the next site); a replica names its source here to be switchable (after "
        "a switchover it mirrors back there: failback)",
    )
    targets: list[MirrorTarget] | None = Field(
        None,
        min_length=2,
        max_length=MESH_MAX_TARGETS,
        description="A full mesh (role bidirectional, instead of `target`): every other "
        "site of the mesh, each mirrored to over its own link with its own cursor, only "
        "this site's own events sent (docs/mirror.md, Full mesh); each site of the "
        "mesh names all the others",
    )
    secret_name: str = Field(
        min_length=1,
        max_length=253,
        description="Secret with key `mirror-token`, the same on both sites",
    )
    max_lag_seconds: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="A source blocks publishers while its oldest unmirrored event is older "
        "than this and the mirror is connected and consuming (0: never)",
    )
    tls: MirrorTls = Field(
        default_factory=MirrorTls,
        description="Mutual TLS on the link (on when the other site's CA is known)",
    )

    def all_targets(self) -> list[MirrorTarget]:
        """The sites this one mirrors to: `targets` (a mesh), else `target` (or none)."""
        if self.targets:
            return list(self.targets)
        return [] if self.target is None else [self.target]


AMQP_NAME = r"^[A-Za-z0-9_.:-]+$"
"""The AMQP spec's name characters: the only ones a federated exchange (and the server
identifier in its link queue's name) may use (the client library refuses others)."""
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ClusterReference(ApiModel):
    """A BrokerCluster, in this namespace or another one."""

    name: str = Field(min_length=1, max_length=63, pattern=DNS_LABEL)
    namespace: str | None = Field(
        None, min_length=1, max_length=63, pattern=DNS_LABEL,
        description="Default: this BrokerCluster's namespace",
    )  # fmt: skip


class SecretKeyReference(ApiModel):
    """A key of a Secret in this BrokerCluster's namespace."""

    name: str = Field(min_length=1, max_length=253)
    key: str = Field("password", min_length=1, max_length=253)


class FederationUpstreamTls(ApiModel):
    """amqps to the upstream, verified against its CA (docs/federation.md, "TLS to the
    upstream"): a BrokerCluster upstream's own CA differs from this cluster's. On by default
    for a `clusterRef` upstream: the operator copies its CA and issues this cluster's
    client certificate (`operator/federationtls.py`)."""

    enabled: bool = Field(
        True,
        description="false: a clusterRef upstream is dialled on its plain AMQP port (5672). "
        "A clusterRef upstream without `tls` is dialled on AMQPS",
    )
    ca_config_map: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="ConfigMap in this namespace with the upstream's CA certificate. Default "
        "for a clusterRef: the operator's copy of the upstream's published `<name>-ca` (in "
        "`<cluster>-federation-peer-ca`); required for a uri",
    )
    ca_key: str = Field("ca.crt", min_length=1, max_length=253, description="Its key")
    client_secret: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="A `kubernetes.io/tls` Secret (`tls.crt`, `tls.key`) with the client "
        "certificate to present. Default for a clusterRef: `<cluster>-federation-tls`, "
        "issued by this cluster's CA (operator-managed or spec.tls.issuerRef)",
    )
    server_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="The name the upstream's certificate is checked for (default: the host "
        "the link dials, a clusterRef's `<name>.<namespace>.svc`)",
    )


class FederationUpstream(ApiModel):
    """A broker (pair) this cluster federates exchanges from: another BrokerCluster (reached
    through its virtual IP, so the link follows its failovers) or any AMQP URI."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.clusterRef) != has(self.uri)",
                    "message": "an upstream names a clusterRef or a uri, not both",
                },
                {
                    "rule": "!has(self.uri) || !self.uri.matches('^amqps?://[^/@]*:[^/@]*@')",
                    "message": "an upstream uri must not carry a password: give passwordSecret",
                },
                {
                    "rule": "!has(self.tls) || !has(self.uri) || self.uri.startsWith('amqps://')",
                    "message": "an upstream with tls needs an amqps:// uri",
                },
                {
                    "rule": "!has(self.tls) || !has(self.uri) || has(self.tls.caConfigMap)",
                    "message": "an upstream uri with tls needs tls.caConfigMap (the operator "
                    "copies the CA of a clusterRef upstream only)",
                },
                {
                    "rule": "has(self.passwordSecret) || (has(self.clusterRef) && "
                    "!has(self.clusterRef.namespace))",
                    "message": "passwordSecret is required, except for a clusterRef without "
                    "a namespace (its generated Secret <name>-auth is used then)",
                },
            ]
        }
    )

    name: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL,
        description="The upstream's name (exchanges refer to it)",
    )  # fmt: skip
    cluster_ref: ClusterReference | None = Field(
        None, description="A BrokerCluster: its virtual-IP Service's AMQP port"
    )
    uri: str | None = Field(
        None, max_length=1024, pattern=r"^amqps?://",
        description="amqp://USER@HOST:PORT/ (never a password: passwordSecret holds it)",
    )  # fmt: skip
    user: str = Field(
        "twinmq-federation", min_length=1, max_length=255,
        description="The user a clusterRef upstream is logged in as (a uri names its own); "
        "the upstream must tag it 'federation' (its generated users file does: "
        "twinmq-federation)",
    )  # fmt: skip
    password_secret: SecretKeyReference | None = Field(
        None,
        description="The upstream user's password (mounted as a file: a rotated Secret is "
        "read at the next connection). Default for a clusterRef without a namespace: its "
        "generated credentials Secret <name>-auth, key federation-password",
    )
    reconnect_max_seconds: int = Field(
        30, ge=1, le=3600, description="Longest pause between two connection attempts"
    )
    tls: FederationUpstreamTls | None = Field(
        None,
        description="amqps (a clusterRef's AMQPS port, 5671) verified against the upstream's "
        "CA, with a client certificate. Unset for a clusterRef: on, the CA copied and the "
        "client certificate issued by the operator; unset for a uri: plaintext",
    )


class FederatedExchange(ApiModel):
    """A local exchange receiving what an upstream exchange routes to its bindings (the
    local bindings go upstream, normalised: each message crosses the link once)."""

    # The broker refuses global-keys on a fanout or headers exchange at start-up (its pods
    # would crash-loop): refused here, where the type is always known (it defaults to topic).
    model_config = ConfigDict(
        json_schema_extra=cel(
            "!has(self.globalKeys) || !self.globalKeys || !has(self.type) || "
            "self.type == 'direct' || self.type == 'topic'",
            "globalKeys needs a direct or topic exchange (fanout and headers exchanges do "
            "not route by the routing key)",
        )
    )

    exchange: str = Field(
        min_length=1, max_length=127, pattern=AMQP_NAME,
        description="The local exchange (declared if missing)",
    )  # fmt: skip
    # Optional, not defaulted: unset, the file and its hash stay as they were (no rollout).
    vhost: str | None = Field(
        None, min_length=1, max_length=255,
        description="The local exchange's vhost (default: /); the brokers' users file must "
        "serve it for clients to use it",
    )  # fmt: skip
    upstream: str = Field(min_length=1, max_length=63, description="An upstream's name")
    upstream_exchange: str | None = Field(
        None, min_length=1, max_length=127, pattern=AMQP_NAME,
        description="The exchange on the upstream (default: the same name)",
    )  # fmt: skip
    upstream_vhost: str | None = Field(
        None, min_length=1, max_length=255,
        description="The upstream exchange's vhost, which the link opens as its user (default: "
        "the vhost a uri upstream's path names, else the same name as vhost)",
    )  # fmt: skip
    type: Literal["direct", "topic", "fanout", "headers"] = Field(
        "topic", description="Its type, here and upstream (declared if missing)"
    )
    max_hops: int = Field(1, ge=1, le=32, description="Federation links a message may cross")
    prefetch: int = Field(
        256, ge=1, le=65535, description="Unacknowledged deliveries on the link at most"
    )
    forward: bool = Field(
        False,
        description="Also forward what this cluster's clients publish on the exchange to the "
        "upstream (request-response across sites; docs/federation.md, 'Forwarding')",
    )
    global_keys: bool = Field(
        False,
        description="Global routing keys for request-response: this cluster's temporary "
        "queues are bound to the exchange under <server id><separator><name>, and a reply-to "
        "naming one is made global (direct and topic exchanges; docs/federation.md, 'Global "
        "routing keys')",
    )


class Federation(ApiModel):
    """Exchange federation (docs/federation.md): this cluster's server identifier, and the
    exchanges it federates from upstreams (as a downstream). An upstream needs a section
    too (`federation: {}` at least): both brokers of its pair then announce one identifier,
    so a failover there is not taken for another server."""

    # The second rule is the broker's refusal of two exchanges sharing one link queue (its
    # pods would crash-loop on the file): the upstream vhost as the broker resolves it
    # (`upstreamVhost`, else `vhost`, else `/`), exact except for a uri upstream whose
    # path names a vhost (then the path decides), left to the broker.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.exchanges) || self.exchanges.all(e, has(self.upstreams) "
                    "&& self.upstreams.exists(u, u.name == e.upstream))",
                    "message": "every federated exchange names one of spec.federation.upstreams",
                },
                {
                    "rule": "!has(self.exchanges) || self.exchanges.all(e, (has(self.upstreams)"
                    " && self.upstreams.exists(u, u.name == e.upstream && has(u.uri) && "
                    "u.uri.matches('^amqps?://[^/]+/.+'))) || self.exchanges.exists_one(f, "
                    "f.upstream == e.upstream && "
                    "(has(f.upstreamExchange) ? f.upstreamExchange : f.exchange) == "
                    "(has(e.upstreamExchange) ? e.upstreamExchange : e.exchange) && "
                    "(has(f.upstreamVhost) ? f.upstreamVhost : has(f.vhost) ? f.vhost : '/') =="
                    " (has(e.upstreamVhost) ? e.upstreamVhost : has(e.vhost) ? e.vhost : '/')))",
                    "message": "two exchanges federate one upstream exchange in one upstream "
                    "vhost: they would share one link queue",
                },
            ]
        }
    )

    server_id: str | None = Field(
        None, min_length=1, max_length=100, pattern=AMQP_NAME,
        description="This pair's identifier, unique across the federation (a peer announcing "
        "the same one is refused). Default: <namespace>.<name>",
    )  # fmt: skip
    # Unique by CEL, not as list-type map: a server-side apply of duplicate map keys fails
    # with an internal error instead of naming the field.
    upstreams: list[FederationUpstream] = Field(
        default_factory=list, max_length=16,
        json_schema_extra=cel("self.all(u, self.exists_one(v, v.name == u.name))",
                              "each upstream name appears once"),
    )  # fmt: skip
    exchanges: list[FederatedExchange] = Field(
        default_factory=list, max_length=128,
        json_schema_extra=cel(
            "self.all(e, self.exists_one(f, f.exchange == e.exchange && "
            "(has(f.vhost) ? f.vhost : '/') == (has(e.vhost) ? e.vhost : '/')))",
            "each exchange is federated once (per vhost)",
        ),
    )  # fmt: skip
    dedup_window: int = Field(
        100_000, ge=1, le=10_000_000,
        description="(origin, sequence) keys remembered against re-deliveries",
    )  # fmt: skip
    # Optional, not defaulted: only what is set goes into the brokers' file, so an operator
    # upgrade adding a field leaves an unchanged spec's pods alone.
    global_key_separator: str | None = Field(
        None, min_length=1, max_length=8, pattern=r"^[A-Za-z0-9\-_.:]+$",
        description="Between the server id and the local name in a global routing key (and "
        "in server-named queues, amq.gen-<server id><separator><token>). Default: .",
    )  # fmt: skip
    status_interval_seconds: int | None = Field(
        None, ge=0, le=86400,
        description="A link-status message per link on amq.peer this often (0: none). "
        "Default: 30",
    )  # fmt: skip
    downstream_ca_config_map: str | None = Field(
        None, min_length=1, max_length=253,
        description="As an upstream: a ConfigMap of this namespace (key ca.crt) with the CAs "
        "of downstream sites; AMQPS then asks clients for a certificate, optional (an "
        "ordinary client presents none), verified against these CAs when presented. Default: "
        "the operator's copy of the CAs of the BrokerClusters naming this one as a clusterRef "
        "upstream (`<cluster>-federation-downstream-ca`), when there are any",
    )  # fmt: skip


class Failover(ApiModel):
    """How the operator decides an automatic failover."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "self.leaseDurationSeconds > self.probeIntervalSeconds",
            "leaseDurationSeconds must be longer than probeIntervalSeconds",
        )
    )

    probe_interval_seconds: int = Field(1, ge=1, le=60, description="Broker probe period")
    failure_threshold: int = Field(
        2, ge=1, le=20, description="Consecutive failed probes before a broker is unreachable"
    )
    lease_duration_seconds: int = Field(
        4, ge=2, le=300, description="Active role Lease; the active stops serving if it cannot "
        "renew within it",
    )  # fmt: skip
    allow_data_loss: bool = Field(
        False, description="Promote a backup that is not ready (may lose confirmed messages)"
    )


class Replication(ApiModel):
    """Broker replication settings."""

    timeout_seconds: float = Field(
        8.0,
        gt=0,
        le=300,
        description="A silent passive holds up confirms at most this long; a passive stays "
        "promotable that long after losing the active",
    )
    dedup_window: int = Field(
        100_000, ge=0, description="Message ids kept for deduplication, per vhost"
    )


class Limits(ApiModel):
    """Limits against exhaustion, per broker: the broker's flags of the same names, set only
    where given (unset: the broker's default, so adding this section rolls nothing out)."""

    max_connections: int | None = Field(
        None, ge=0, description="Client connections at most; more are closed at once (0: none)"
    )
    max_connections_per_user: int | None = Field(
        None, ge=0, description="Connections per user at most; more are refused with 530"
    )
    max_queues: int | None = Field(
        None,
        ge=0,
        description="Queues at most per vhost; a declare beyond is refused with 406 (0: none)",
    )
    max_queue_length: int | None = Field(
        None,
        ge=0,
        description="Ready messages at most in any queue, over each queue's own x-max-length; "
        "a publish beyond is refused as by reject-publish (nacked), never dropping one (0: none)",
    )
    max_queue_length_bytes: int | None = Field(
        None,
        ge=0,
        description="Ready messages' body bytes at most in any queue, likewise (0: none)",
    )
    channel_max: int | None = Field(
        None, ge=1, le=65535, description="Channels per connection at most (default 2047)"
    )
    max_message_size: int | None = Field(
        None,
        ge=1,
        le=512 * 1024 * 1024,
        description="Largest message body accepted, bytes (default 128 MiB)",
    )


class NetworkPolicy(ApiModel):
    """A NetworkPolicy for the broker pods (operator/netpolicy.py): AMQP and the mirror port
    open, replication between the two brokers only, the admin port for the operator and
    the namespaces named here. Opt-out."""

    enabled: bool = Field(True, description="Create and keep the brokers' NetworkPolicy")
    admin_namespaces: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="Namespaces whose pods may also reach the admin port (Prometheus "
        "scraping /metrics with the metrics token)",
    )


SPARK_MEMORY = r"^[0-9]+[kmgt]$"
"""A Spark memory amount (`512m`, `2g`)."""


class IssuerReference(ApiModel):
    """A cert-manager Issuer or ClusterIssuer (`cert-manager.io`)."""

    name: str = Field(min_length=1, max_length=253, description="The issuer's name")
    kind: Literal["Issuer", "ClusterIssuer"] = Field(
        "Issuer", description="Issuer (this namespace) or ClusterIssuer"
    )
    group: str = Field("cert-manager.io", min_length=1, max_length=253, description="API group")


ClientCertificateMode = Literal["none", "optional", "required"]
"""Whether AMQPS asks applications for a certificate (the broker's `--tls-client-certs`)."""

CertificateLogin = Literal["commonName", "distinguishedName", "sanDns", "sanEmail"]
"""Where a certificate login takes the user name from (the broker's `--tls-cert-login`:
`common_name`, `distinguished_name`, `san_dns`, `san_email`)."""

CERTIFICATE_LOGIN_ARGS: dict[CertificateLogin, str] = {
    "commonName": "common_name",
    "distinguishedName": "distinguished_name",
    "sanDns": "san_dns",
    "sanEmail": "san_email",
}
"""`login`'s value as the broker's `--tls-cert-login` says it."""


class ClientCertificates(ApiModel):
    """Mutual TLS with applications on AMQPS (RabbitMQ's `verify_peer`, its cluster
    operator's `tls.caSecretName`): the CA bundle client certificates are verified
    against, from a ConfigMap or a Secret of this namespace, reloaded by the brokers when
    it changes (docs/security.md, "Client certificates")."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.mode == 'none' || has(self.caConfigMap) "
                    "|| has(self.caSecretName)",
                    "message": "client certificates optional or required need a CA bundle: "
                    "caConfigMap or caSecretName",
                },
                {
                    "rule": "!has(self.caConfigMap) || !has(self.caSecretName)",
                    "message": "one CA bundle: caConfigMap or caSecretName, not both",
                },
                {
                    "rule": "!has(self.login) || self.mode != 'none'",
                    "message": "a certificate login needs client certificates verified: "
                    "mode optional or required",
                },
            ]
        }
    )

    mode: ClientCertificateMode = Field(
        "required",
        description="`required`: an application without a certificate signed by a CA of the "
        "bundle is refused at the handshake; `optional`: one may present none (and logs in "
        "with its password), one presented must verify; `none`: no certificate asked for",
    )
    ca_config_map: str | None = Field(
        None, min_length=1, max_length=253,
        description="ConfigMap in this namespace with the CA bundle (PEM, key `caKey`)",
    )  # fmt: skip
    ca_secret_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="Secret in this namespace with the CA bundle (PEM, key `caKey`); its "
        "author must be allowed to read it (the admission policy checks)",
    )  # fmt: skip
    ca_key: str = Field("ca.crt", min_length=1, max_length=253, description="The bundle's key")
    login: CertificateLogin | None = Field(
        None,
        description="Certificate login (SASL EXTERNAL, RabbitMQ's rabbitmq_auth_mechanism_ssl): "
        "an application presenting a verified certificate may log in as the user it names, "
        "taken from its `commonName`, its whole subject (`distinguishedName`, RFC 4514) or "
        "its first DNS (`sanDns`) or e-mail (`sanEmail`) subject alternative name; the user "
        "must be in the users file (one without a password logs in only so). Unset: no "
        "certificate login",
    )


class Tls(ApiModel):
    """AMQPS (5671) beside AMQP (5672): the brokers' server certificate, from an
    operator-managed CA per BrokerCluster (the default), a Secret of your own, or
    cert-manager (docs/security.md, "Certificates"); and, if asked for, the applications'
    client certificates."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "!has(self.clientCertificates) || self.clientCertificates.mode == 'none' "
            "|| self.enabled",
            "client certificates are verified on AMQPS: they need tls.enabled",
        )
    )

    enabled: bool = Field(True, description="Serve AMQPS on 5671 beside AMQP on 5672")
    secret_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="A `kubernetes.io/tls` Secret of your own (`tls.crt`, `tls.key`, and "
        "`ca.crt` to publish the CA to clients); with `issuerRef`, the Secret cert-manager "
        "writes (default `<cluster>-tls`). Unset and no `issuerRef`: an operator-managed "
        "CA (`<cluster>-tls-ca`) issues `<cluster>-tls` and renews it before it expires",
    )
    issuer_ref: IssuerReference | None = Field(
        None,
        description="A cert-manager issuer: the operator creates a cert-manager Certificate "
        "(`<cluster>-tls`) for the brokers' names instead of issuing one itself",
    )
    client_certificates: ClientCertificates | None = Field(
        None,
        description="Verify applications' client certificates on AMQPS against a CA bundle "
        "of yours (mutual TLS). Unset: none asked for (unless federation downstreams' CAs "
        "are configured, which makes them optional)",
    )


class SparkResources(ApiModel):
    """Resources of an audit run: the driver (the whole run for the `job` launcher) and,
    on the Spark Operator, the executors."""

    driver_cores: int = Field(1, ge=1, le=64, description="Driver cores (local[N] for `job`)")
    driver_memory: str = Field("1g", pattern=SPARK_MEMORY, description="Driver heap (`2g`)")
    executor_instances: int = Field(1, ge=1, le=1000, description="Executors (SparkApplication)")
    executor_cores: int = Field(1, ge=1, le=64, description="Cores per executor")
    executor_memory: str = Field("1g", pattern=SPARK_MEMORY, description="Heap per executor")


class Audit(ApiModel):
    """Replication audits on Spark: when they run, where, and on which store."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.schedule) || self.schedule.split(' ').size() == 5",
                    "message": "schedule must be a five-field cron expression",
                },
                {
                    "rule": "!self.enabled || has(self.storeUrl)",
                    "message": "audits need a storeUrl (s3://bucket/prefix)",
                },
                {
                    "rule": "!has(self.mirrorStoreUrl) || self.mirrorStoreUrl.startsWith('s3://')",
                    "message": "mirrorStoreUrl is the other DR site's audit store: "
                    "it must start with s3://",
                },
                {
                    "rule": "!has(self.moreMirrorStoreUrls) || (has(self.mirrorStoreUrl) && "
                    "self.moreMirrorStoreUrls.all(u, u.startsWith('s3://')))",
                    "message": "moreMirrorStoreUrls are a ring's or a mesh's further sites' "
                    "audit stores: beside mirrorStoreUrl, each starting with s3://",
                },
                {
                    # Brokers (shipping), audit runs and the operator (reading the summary)
                    # all reach an object store wherever they run; a path would be a
                    # different directory in each pod.
                    "rule": "!has(self.storeUrl) || self.storeUrl.startsWith('s3://')",
                    "message": "in Kubernetes the audit store is an S3-compatible object store: "
                    "storeUrl must start with s3://",
                },
            ]
        }
    )

    enabled: bool = Field(False, description="Ship audit segments and run audits")
    schedule: str | None = Field(
        None, max_length=128, description="Cron schedule of periodic audits (UTC)"
    )
    after_failover: bool = Field(
        True,
        description="Run an audit after every failover, once both brokers are in sync again",
    )
    launcher: Literal["sparkApplication", "job"] = Field(
        "job", description="SparkApplication (Spark Operator) or a Job running Spark locally"
    )
    image: str | None = Field(None, description="Spark image (defaults to the broker image)")
    store_url: str | None = Field(
        None, max_length=1024, description="Audit store of this pair alone: s3://bucket/prefix"
    )
    store_secret_name: str | None = Field(
        None,
        description="Secret with the store credentials as environment variables "
        "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, optional AWS_ENDPOINT_URL, AWS_REGION)",
    )
    mirror_store_url: str | None = Field(
        None,
        max_length=1024,
        description="The other DR site's audit store (s3://, reachable with the same "
        "credentials): cross-site audits compare this site with it (docs/audit.md)",
    )
    more_mirror_store_urls: list[Annotated[str, Field(max_length=1024)]] | None = Field(
        None,
        max_length=MESH_MAX_TARGETS,
        description="A ring's or a full mesh's further sites' audit stores, beside "
        "mirrorStoreUrl: cross-site audits compare every site with every other",
    )
    after_mirror_switch: bool = Field(
        True,
        description="With mirrorStoreUrl: run a cross-site audit after every DR switchover "
        "or failover this site takes part in (a new DR epoch), once both sites have shipped",
    )
    resources: SparkResources = Field(default_factory=SparkResources)
    service_account_name: str = Field(
        "spark-operator-spark",
        min_length=1,
        description="The Spark driver's ServiceAccount (SparkApplication), allowed to run "
        "executor pods: the default is the one the Spark Operator's chart creates",
    )
    timeout_seconds: int = Field(
        3600, ge=60, le=86400, description="A run still going after this long is stopped (ERROR)"
    )
    history_limit: int = Field(3, ge=1, le=50, description="Finished audit runs kept")
    segment_seconds: int = Field(
        60,
        ge=1,
        le=3600,
        description="Brokers close (and make shippable) audit segments this often",
    )
    keep_shipped_seconds: int = Field(
        3600,
        ge=0,
        le=30 * 86400,
        description="The shipper deletes a broker's local audit segments this long after "
        "the broker closed them, once the store holds them (each broker's newest kept); "
        "unshipped ones are never deleted. Without audits (`enabled: false`) brokers "
        "write no audit log at all",
    )


class PromoteRequest(ApiModel):
    """Switch the active role to `broker` (a switchover)."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")
    broker: BrokerName
    force: bool = Field(False, description="Promote even if the target is not ready")


class RecoverRequest(ApiModel):
    """Fail back to the primary: demote the backup, wait for it to report passive, activate."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")


class FenceRequest(ApiModel):
    """Fence (stop serving) or unfence a broker."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")
    broker: BrokerName
    fenced: bool = True


class AuditRequest(ApiModel):
    """Run an audit now."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")
    sites: bool = Field(
        False,
        description="Audit this DR site against the other (spec.audit.mirrorStoreUrl) "
        "instead of the pair",
    )


class MirrorDemoteRequest(ApiModel):
    """DR switchover, first half (on the source site): stop taking writes, drain every
    event to the mirror, and publish the demotion token in `status.mirror.demotionToken`."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")


class MirrorReseedRequest(ApiModel):
    """Seed the mirror again from this (source) site: leaves NeedsResync; what the mirror
    holds and the source does not goes to its orphan queue (docs/mirror.md)."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")


class MirrorFailbackRequest(ApiModel):
    """DR failback, declared on the site that is the source now (after a switchover or a
    forced failover): wait until the site it mirrors to is re-attached as its replica (the
    old source fences itself, is reversed and, after a forced failover, re-seeded: what
    only it held goes to its orphan queue) and in sync, then demote this site with a
    demotion token for that site's mirrorPromote. Progress in `status.mirror.failback`."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")


class MirrorPromoteRequest(ApiModel):
    """DR switchover, second half (on the replica site), with the source's demotion token;
    or, the source site being gone, a forced DR failover (its RPO reported, not hidden)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            "has(self.token) != self.force",
            "give the source's demotion token, or force (a DR failover), not both",
        )
    )

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")
    token: str | None = Field(
        None,
        max_length=1024,
        description="The source's status.mirror.demotionToken, as it is written there",
    )
    force: bool = Field(False, description="Promote without a token: the source site is gone")


class RotateCaRequest(ApiModel):
    """Rotate the operator-managed CA (a leaked key, a policy): a new CA is published
    beside the old one, signs after the grace period, and the old one leaves the bundle
    after another (docs/security.md, "Rotating the managed CA"). Progress in
    `status.caRotation`."""

    id: str = Field(min_length=1, max_length=63, description="Unique id; handled once")


class CaRotation(ApiModel):
    """Where a rotation of the operator-managed CA stands (`operator/carotation.py`)."""

    phase: Literal["Staged", "Switched", "Complete"] = Field(
        description="Staged: a new CA is trusted beside the old one, signing nothing yet; "
        "Switched: the new CA signs, the old one is still trusted; Complete: the old CA is "
        "no longer published"
    )
    since: str = Field(description="When this phase began", json_schema_extra=DATE_TIME)
    next_step_at: str | None = Field(
        None, description="When the next phase begins", json_schema_extra=DATE_TIME
    )
    request: str | None = Field(None, description="The last rotateCa request id handled")
    reason: str = Field("", description="Why the rotation started")
    waiting: str | None = Field(
        None,
        description="Why the next phase waits past its time: the broker pods that have not "
        "loaded this phase's files (each pod's trust bundle and certificate, as its /status "
        "reports them), and why",
    )


class Requests(ApiModel):
    """Manual operations, declared: each carries an id, and an id is handled only once."""

    promote: PromoteRequest | None = None
    recover: RecoverRequest | None = None
    fence: FenceRequest | None = None
    audit: AuditRequest | None = None
    mirror_demote: MirrorDemoteRequest | None = None
    mirror_promote: MirrorPromoteRequest | None = None
    mirror_reseed: MirrorReseedRequest | None = None
    mirror_failback: MirrorFailbackRequest | None = None
    rotate_ca: RotateCaRequest | None = None


# -- placement and pod template overrides (the Kubernetes core/v1 shapes, as used) ----------


class LabelSelectorRequirement(ApiModel):
    """A label selector requirement (Kubernetes `LabelSelectorRequirement`)."""

    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None


class LabelSelector(ApiModel):
    """A label selector (Kubernetes `LabelSelector`)."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None


class NodeSelectorRequirement(ApiModel):
    """A node selector requirement (Kubernetes `NodeSelectorRequirement`)."""

    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] | None = None


class NodeSelectorTerm(ApiModel):
    """Node requirements, ANDed (Kubernetes `NodeSelectorTerm`)."""

    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(ApiModel):
    """Node selector terms, ORed (Kubernetes `NodeSelector`)."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1)


class PreferredSchedulingTerm(ApiModel):
    """A weighted node preference (Kubernetes `PreferredSchedulingTerm`)."""

    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ApiModel):
    """Node affinity (Kubernetes `NodeAffinity`)."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = (
        None
    )


class PodAffinityTerm(ApiModel):
    """Pods to be (or not be) co-located with (Kubernetes `PodAffinityTerm`)."""

    label_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    namespaces: list[str] | None = None
    topology_key: str = Field(min_length=1, max_length=317)
    match_label_keys: list[str] | None = None
    mismatch_label_keys: list[str] | None = None


class WeightedPodAffinityTerm(ApiModel):
    """A weighted pod affinity term (Kubernetes `WeightedPodAffinityTerm`)."""

    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ApiModel):
    """Pod affinity or anti-affinity (Kubernetes `PodAffinity` / `PodAntiAffinity`)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = (
        None
    )


class Affinity(ApiModel):
    """Scheduling constraints (Kubernetes `Affinity`). Its pod anti-affinity terms are added
    to the brokers' own (`placement.antiAffinity`), not put in their place."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class Toleration(ApiModel):
    """A toleration of a node taint (Kubernetes `Toleration`)."""

    key: str | None = Field(None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class TopologySpreadConstraint(ApiModel):
    """How to spread the broker pods over a topology (Kubernetes
    `TopologySpreadConstraint`)."""

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1, max_length=317)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1)
    match_label_keys: list[str] | None = None
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None


class LocalObjectReference(ApiModel):
    """A Secret in the cluster's namespace, by name."""

    name: str = Field(min_length=1, max_length=253)


RESERVED_KEYS = ("twinmq.io/", "app.kubernetes.io/")
"""Label and annotation key prefixes the operator owns on its pods (selectors, the
template hash): a pod template override cannot set them."""


def _no_reserved_keys(field: str) -> str:
    keys = " && ".join(f"!k.startsWith('{prefix}')" for prefix in RESERVED_KEYS)
    return f"!has(self.{field}) || self.{field}.all(k, {keys})"


class PodMetadata(ApiModel):
    """Labels and annotations added to both broker pods."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": _no_reserved_keys(field),
                    "message": f"podTemplate.metadata.{field} cannot use the operator's own "
                    "prefixes twinmq.io/ and app.kubernetes.io/ (its selectors rely on them)",
                }
                for field in ("labels", "annotations")
            ]
        }
    )

    labels: dict[str, str] | None = Field(None, max_length=64)
    annotations: dict[str, str] | None = Field(None, max_length=64)


class PodTemplate(ApiModel):
    """Overrides of both broker pods, merged into what the operator builds (as CloudNativePG's
    `affinity` and Strimzi's `template.pod`). A change rolls out like any pod template
    change: the passive first, then a switchover."""

    metadata: PodMetadata | None = None
    affinity: Affinity | None = None
    node_selector: dict[str, str] | None = Field(None, max_length=64)
    tolerations: list[Toleration] | None = Field(None, max_length=64)
    topology_spread_constraints: list[TopologySpreadConstraint] | None = Field(None, max_length=16)
    image_pull_secrets: list[LocalObjectReference] | None = Field(None, max_length=16)
    priority_class_name: str | None = Field(None, min_length=1, max_length=253)


class Placement(ApiModel):
    """Where the two brokers run relative to each other."""

    anti_affinity: Literal["required", "preferred"] = Field(
        "required",
        description="required: the two brokers never share a topology domain (a node by "
        "default): a broker that cannot be placed stays Pending. preferred: the scheduler "
        "avoids it but may place both together (a one-node cluster needs this)",
    )
    topology_key: str = Field(
        "kubernetes.io/hostname",
        min_length=1,
        max_length=317,
        description="The node label whose values the brokers must not share",
    )


class BrokerClusterSpec(ApiModel):
    """The desired state of a broker pair. The operator never writes it."""

    # A passive stays promotable for replication.timeoutSeconds after it lost the
    # active; a dead active's Lease lapses within leaseDurationSeconds, seen within a
    # probe: the first must outlast the other two or automatic failover never happens.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.replication.timeoutSeconds > double("
                    "self.failover.leaseDurationSeconds + self.failover.probeIntervalSeconds)",
                    "message": "replication.timeoutSeconds must exceed "
                    "failover.leaseDurationSeconds + failover.probeIntervalSeconds, or a "
                    "ready backup could never be promoted",
                },
                {
                    "rule": "!has(self.audit) || !has(self.audit.mirrorStoreUrl) "
                    "|| has(self.mirror)",
                    "message": "audit.mirrorStoreUrl compares DR sites: it needs spec.mirror",
                },
                {
                    "rule": "!has(self.requests) || !has(self.requests.rotateCa) || "
                    "!has(self.tls) || ((!has(self.tls.enabled) || self.tls.enabled) && "
                    "!has(self.tls.secretName) && !has(self.tls.issuerRef))",
                    "message": "requests.rotateCa rotates the operator-managed CA: not with "
                    "tls.secretName, tls.issuerRef or TLS off",
                },
            ]
        }
    )

    image: str = Field(DEFAULT_IMAGE, min_length=1, description="Broker container image")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: Resources = Field(default_factory=Resources)
    storage: Storage = Field(default_factory=Storage)
    auth: Auth = Field(default_factory=Auth)
    failover: Failover = Field(default_factory=Failover)
    replication: Replication = Field(default_factory=Replication)
    limits: Limits = Field(default_factory=Limits)
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    tls: Tls = Field(default_factory=Tls)
    audit: Audit = Field(default_factory=Audit)
    update_strategy: UpdateStrategy = Field(default_factory=UpdateStrategy)
    placement: Placement = Field(default_factory=Placement)
    pod_template: PodTemplate = Field(default_factory=PodTemplate)
    requests: Requests = Field(default_factory=Requests)
    mirror: Mirror | None = Field(None, description="A DR mirror to or from another site")
    federation: Federation | None = Field(
        None, description="Exchange federation with other BrokerClusters or brokers"
    )


Phase = Literal[
    "Pending", "Creating", "Ready", "Updating", "Degraded", "FailingOver", "Recovering", "Failed"
]
ConditionType = Literal[
    "Ready",
    "Replicating",
    "FailingOver",
    "Degraded",
    "Reconciling",
    "Stalled",
    "AuditPassed",
    "BrokerDamaged",
    "Mirroring",
    "MirrorTls",
    "FailingBack",
    "Federated",
    "FederationTls",
]


class Condition(ApiModel):
    """A Kubernetes-style condition."""

    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = Field(None, json_schema_extra=DATE_TIME)
    observed_generation: int | None = None


class BrokerSummary(ApiModel):
    """One broker as the operator last saw it through its admin API's `GET /status`."""

    name: BrokerName
    pod: str | None = None
    role: Literal["active", "passive", "unknown"] = "unknown"
    reachable: bool = False
    ready: bool = False
    epoch: int = 0
    link_connected: bool = False
    link_tls: bool = Field(
        False, description="Its replication link runs mutual TLS (as this broker reports it)"
    )
    lag_messages: int = Field(
        0,
        description="Replicated messages not yet durable on this broker (0 for the active): "
        "the larger of the active's count for its link and the passive's own",
    )
    lag_seconds: float = Field(0.0, description="Age of the oldest of those messages")
    fenced: bool = False
    damaged: bool = Field(
        False,
        description="Its journal recovered with corruption and no catch-up has made it whole "
        "since: it may lack messages it confirmed, and is activated only by a forced promote",
    )
    damage: str = Field(
        "",
        description="Since when, and where the damaged files were moved (quarantine); empty "
        "when not damaged",
    )  # not None: a merge patch's null would delete the key, and kopf warns at every patch


MirrorStateName = Literal[
    "Connected", "Disconnected", "Listening", "NeedsResync", "Fenced", "Unknown"
]
FailbackPhase = Literal["", "Reattaching", "Syncing", "Demoting", "Promoting", "Done", "Refused"]


class MirrorFailback(ApiModel):
    """A mirrorFailback request's progress on the site that is handing the source role back
    (docs/mirror.md, "Failback"); empty strings when none was asked (not None: a merge
    patch's null would delete the key)."""

    id: str = Field("", description="The request's id")
    phase: FailbackPhase = Field(
        "",
        description="Reattaching: waiting for the link to the other site, which accepts it "
        "only as a replica (re-seeded after a forced failover). Syncing: waiting for the "
        "backlog to drain. Demoting: clients refused, the rest drained. Promoting: demoted, "
        "waiting for the other site's promotion with `token`. Done, or Refused (why in "
        "`message`)",
    )
    message: str = Field("", description="What the phase waits for, or the outcome")
    token: str = Field("", description="From Promoting on: the demotion token (JSON, as is)")
    started: str = Field("", description="When the request was taken (RFC 3339)")
    since: str = Field("", description="When the current phase began (RFC 3339)")


class MirrorTargetState(ApiModel):
    """One target of a full-mesh site: its own link and backlog, as the active reports it."""

    target: str = Field(description="The target's address, as the site dials it")
    peer: str = Field("", description="Its site id (`<namespace>/<name>`), once it answered")
    state: MirrorStateName = Field(
        "Unknown",
        description="Connected once a heartbeat came back over this link, NeedsResync once "
        "its backlog passed the retention bound, Fenced, else Disconnected",
    )
    connected: bool = Field(False, description="A heartbeat came back over this link")
    lag_seconds: float = Field(0.0, description="Age of its oldest unacknowledged event")
    queue_events: int = Field(0, description="Events of this site it has not acknowledged")
    needs_resync: str = Field("", description="Why its backlog was dropped: re-seed it")
    message: str = Field("", description="Why its link is not connected, when known")


class MirrorState(ApiModel):
    """The DR mirror as the active broker reports it (`GET /status`, `mirror`)."""

    role: MirrorRoleName = Field(
        description="The site's DR role now (a switchover changes it; the spec says the first one)"
    )
    state: MirrorStateName = Field(
        "Unknown",
        description="A source or bidirectional site: its outgoing link, Connected once a "
        "heartbeat came back over it, NeedsResync once its backlog passed the retention bound, "
        "Fenced once a newer site took over. A replica: Connected while a source is linked, "
        "else Listening. Unknown: no active broker answered",
    )
    inbound: Literal["", "Connected", "Listening", "Unknown"] = Field(
        "",
        description="A bidirectional site's incoming direction: Connected while the site "
        "before it is linked, else Listening (empty for a one-way site: `state` says it)",
    )  # not None: a merge patch's null would delete the key, and kopf warns at every patch
    epoch: int = Field(0, description="The site's DR epoch (the highest one is writable)")
    message: str = Field("", description="Why the link is not connected, when known")
    target: str = ""
    queue_events: int = Field(0, description="Events not yet acknowledged by the mirror")
    queue_bytes: int = 0
    lag_seconds: float = Field(0.0, description="Age of the oldest unmirrored event")
    flow_control: bool = Field(False, description="Publishers blocked for the mirror's lag")
    sources_connected: int = 0
    tls: bool = Field(False, description="The link runs mutual TLS (the active reports it)")
    orphans: int = Field(
        0,
        description="A replica: messages a seed showed the source lacks, kept in its queue "
        "amq.twinmq.mirror-orphans (never discarded: read or purge them)",
    )
    unmirrored: str = Field(
        "",
        description="An old source reversed after a forced failover: what it had journaled "
        "that the promoted site never applied (the RPO as a count, known once it is back)",
    )
    seed_pending: str = Field(
        "",
        description="A site promoted by force whose seed for the old source is not durable "
        "yet (a full disk): why. It refuses clients (320) until a seed is durable, retried "
        "when the disk has room",
    )
    demotion_token: str = Field(
        "",
        description="After a mirrorDemote request: the token to give the replica's "
        "mirrorPromote request (JSON, as is)",
    )
    last_switch: str = Field("", description="The last DR switch here: when, what, the RPO")
    failback: MirrorFailback = Field(
        default_factory=MirrorFailback, description="The last mirrorFailback request here"
    )
    targets: list[MirrorTargetState] = Field(
        default_factory=list,
        description="A full mesh: each target's link (`state` is the worst of them)",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["target"],
        },
    )


FederationLinkStateName = Literal["Running", "Connecting", "Refused", "Unknown"]


class FederationLinkState(ApiModel):
    """One federated exchange's link as the active broker reports it."""

    exchange: str
    vhost: str = Field("/", description="The local exchange's vhost")
    upstream: str
    state: FederationLinkStateName = Field(
        "Unknown",
        description="Running only after a verified round trip (exchange and queue declared, "
        "bindings synchronised, consumer registered); Refused: a duplicate server id",
    )
    connected: bool = False
    upstream_server_id: str = ""
    message: str = Field("", description="Why the link is not running (its last error)")
    bindings: int = Field(0, description="Normalised bindings held on the upstream")
    local_bindings: int = Field(0, description="Local bindings they stand for")
    messages_received: int = Field(0, description="Republished here (since the broker started)")
    duplicates_dropped: int = 0
    loops_dropped: int = 0
    forwarded: int = Field(
        0, description="Published here and forwarded, confirmed upstream (since the broker "
        "started; forward: true)",
    )  # fmt: skip
    forward_pending: int = Field(0, description="Not yet forwarded or not yet confirmed upstream")
    stale_unbound: int = Field(
        0, description="Upstream bindings of the link's queue removed at a resync: nothing "
        "here wanted them any more",
    )  # fmt: skip
    upstream_epoch: int | None = Field(
        None, description="The upstream's epoch, from its replicated state (a change: it "
        "failed over)",
    )  # fmt: skip
    upstream_state_seq: int | None = Field(
        None, description="The upstream's change counter as of the last change applied here"
    )


class FederationState(ApiModel):
    """Federation as the active broker reports it (`GET /status`, `federation`)."""

    server_id: str = ""
    links: list[FederationLinkState] = Field(
        default_factory=list,
        # Keyed by vhost too: two vhosts' exchanges of one name are two links (`vhost`
        # defaults to `/`, as a map key must have a default or be required).
        json_schema_extra={
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["exchange", "vhost"]
        },
    )  # fmt: skip
    running: str = Field("", description="Links running / links (a printer column)")
    refused_peers: list[str] = Field(
        default_factory=list,
        description="Upstream side: the last downstreams refused for announcing this "
        "cluster's own server id",
    )
    downstream_queues: int = Field(
        0, description="Upstream side: link queues held here for downstreams"
    )
    peer_status_received: int = Field(
        0,
        description="Upstream side: downstream links' status messages published on this "
        "cluster's amq.peer (since its active started)",
    )
    peer_status_dropped: int = Field(
        0,
        description="Upstream side: downstream links' status messages dropped (the link's "
        "user may not write to amq.peer, or the message was persistent)",
    )
    peer_status: str = Field(
        "", description="amq.peer status messages from downstreams: received/dropped "
        "(a printer column)",
    )  # fmt: skip
    duplicate_of: str = Field(
        "",
        description="Another BrokerCluster (namespace/name) created earlier with the same "
        "server id: this one's peers will refuse it (change spec.federation.serverId)",
    )


class FailoverRecord(ApiModel):
    """The last failover or switchover."""

    time: str = Field(json_schema_extra=DATE_TIME)
    from_broker: BrokerName = Field(alias="from")
    to_broker: BrokerName = Field(alias="to")
    reason: str
    epoch: int
    duration_seconds: float | None = None


AuditVerdict = Literal["PASS", "FAIL", "ERROR", "RUNNING"]
AuditScope = Literal["pair", "sites"]


class AuditResult(ApiModel):
    """The last audit run: RUNNING while it runs, then its verdict."""

    time: str = Field(description="When the run started", json_schema_extra=DATE_TIME)
    verdict: AuditVerdict
    run: str = Field("", description="The run (its Job or SparkApplication, and store folder)")
    launcher: Literal["sparkApplication", "job"] = "job"
    scope: AuditScope = Field(
        "pair", description="pair: the two brokers; sites: this DR site against the other"
    )
    reason: str = Field("", description="Why it ran: schedule, failover, request")
    finished: str | None = Field(None, json_schema_extra=DATE_TIME)
    messages: int = 0
    lost: int = 0
    duplicates: int = 0
    reordered: int = 0
    message: str = ""


class AuditProgress(ApiModel):
    """The operator's bookkeeping of audits (so a restarted operator neither repeats nor
    forgets a run)."""

    last_scheduled: str | None = Field(
        None, description="The last cron time a run started for", json_schema_extra=DATE_TIME
    )
    audited_epoch: int = Field(0, description="The failover epoch last audited")
    audited_dr_epoch: int = Field(0, description="The DR epoch last audited across sites")
    dr_epoch_seen: str | None = Field(
        None,
        description="When the operator first saw the DR epoch not audited yet (its cross-site "
        "run waits for both sites to ship)",
        json_schema_extra=DATE_TIME,
    )


class HandledRequests(ApiModel):
    """The ids of the manual requests already handled (never replayed)."""

    promote: str | None = None
    recover: str | None = None
    fence: str | None = None
    audit: str | None = None
    mirror_demote: str | None = None
    mirror_promote: str | None = None
    mirror_reseed: str | None = None
    mirror_failback: str | None = None
    rotate_ca: str | None = None


class SwitchoverProgress(ApiModel):
    """A move of the active role in progress (promote or recover), so a restarted
    operator resumes it: the source was told to be passive in `epoch`; the target is
    activated in `epoch` once the source reports passive."""

    request_id: str
    kind: Literal["promote", "recover"]
    target: BrokerName
    epoch: int
    force: bool = False


RolloutStep = Literal[
    "UpdatingPassive", "WaitingForSwitchover", "SwitchingOver", "RestartingActive",
    "Complete", "Stalled",
]  # fmt: skip


class RolloutProgress(ApiModel):
    """A pod template change on its way to the pods (so a restarted operator resumes it and
    a user sees where it is)."""

    revision: str = Field(description="Hash of the desired pod template being rolled out")
    step: RolloutStep
    broker: BrokerName | None = Field(None, description="The broker the step acts on")
    since: str = Field(description="When this step began", json_schema_extra=DATE_TIME)
    message: str = ""


PeerTlsPhase = Literal["Plaintext", "PlainListener", "TlsListener", "Required"]
"""Where the pair stands on the way to mutual TLS between its brokers (replication) and
HTTPS on their admin API (`operator/peertls.py`): each step a rolling update whose brokers
pair with the step before and after it."""


class BrokerClusterStatus(ApiModel):
    """What the operator observed and decided."""

    model_config = ConfigDict(extra="allow")  # kopf keeps its own bookkeeping here

    phase: Phase = "Pending"
    active_broker: BrokerName | None = None
    epoch: int = 0
    brokers: list[BrokerSummary] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    last_failover: FailoverRecord | None = None
    last_audit: AuditResult | None = None
    audit: AuditProgress = Field(default_factory=AuditProgress)
    handled_requests: HandledRequests = Field(default_factory=HandledRequests)
    switchover: SwitchoverProgress | None = None
    fenced_brokers: list[BrokerName] = Field(
        default_factory=list, description="Brokers fenced by request: never promoted"
    )
    rollout: RolloutProgress | None = None
    mirror: MirrorState | None = None
    federation: FederationState | None = None
    unreachable_since: str | None = Field(None, json_schema_extra=DATE_TIME)
    ca_rotation: CaRotation | None = Field(
        None, description="The operator-managed CA's last rotation (spec.requests.rotateCa)"
    )
    peer_tls: PeerTlsPhase | None = Field(
        None,
        description="The brokers' mutual TLS (replication) and admin HTTPS, one rolling "
        "update a step: Plaintext, PlainListener (replication listeners take plaintext, "
        "passives dial TLS first; admin HTTPS), TlsListener (listeners take TLS only), "
        "Required (TLS only both ways). New clusters start at their target",
    )
    observed_generation: int | None = Field(
        None,
        description="The generation both pods and volumes run: a spec change is observed "
        "only once the rollout it causes is complete",
    )
