"""Broker settings: command-line flags, `TWINMQ_*` environment variables, or a settings file.

Precedence: flags, then environment, then the file named by `--config` /
`TWINMQ_CONFIG` (JSON), then defaults.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from twinmq.broker.names import (
    ACTIVE,
    ADMIN_PORT,
    AMQP_PORT,
    AMQPS_PORT,
    CONFIG_ENV,
    ENV_PREFIX,
    REPLICATION_PORT,
    Role,
)
from twinmq.broker.replication.peer import Peer
from twinmq.broker.tls import CertLogin


class BrokerSettings(BaseSettings):
    """Everything a broker process can be configured with."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    name: str = Field("twinmq", description="Broker name (shown in status, logs, metrics)")
    host: str = Field("0.0.0.0", description="Address the AMQP and admin listeners bind")
    port: int = Field(AMQP_PORT, ge=0, le=65535, description="AMQP port")
    tls_port: int = Field(
        AMQPS_PORT, ge=0, le=65535, description="AMQPS (AMQP over TLS) port, with --tls-cert"
    )
    tls_cert: Path | None = Field(
        None,
        description="PEM certificate (chain) of the AMQPS listener; with --tls-key it opens "
        "--tls-port beside the plain port; reloaded when the file changes",
    )
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert")
    tls_ca: Path | None = Field(
        None,
        description="PEM CA bundle that signs the AMQPS clients' certificates (mutual TLS; "
        "whether one is required: --tls-client-certs)",
    )
    tls_federation_ca: Path | None = Field(
        None,
        description="PEM CA bundle of federation downstreams (other sites' CAs) whose client "
        "certificates AMQPS verifies beside --tls-ca's, for the TLS handshake only: a "
        "certificate they sign never logs in (--tls-cert-login takes --tls-ca's CAs only); "
        "needs --tls-ca and client certificates optional or required",
    )
    tls_client_certs: Literal["none", "optional", "required"] | None = Field(
        None,
        description="AMQPS client certificates: `none` (not asked for), `optional` (asked for; "
        "a client may present none, one presented must verify against --tls-ca), `required` "
        "(a client without one signed by --tls-ca is refused); default `required` with "
        "--tls-ca, else `none`",
    )
    tls_cert_login: CertLogin = Field(
        "off",
        description="Certificate login (SASL EXTERNAL, RabbitMQ's rabbitmq_auth_mechanism_ssl): "
        "offered on AMQPS to a client whose certificate a CA of --tls-ca signed (never one "
        "of --tls-federation-ca), the user named by "
        "the certificate's `common_name`, `distinguished_name` (RFC 4514), first DNS "
        "(`san_dns`) or e-mail (`san_email`) subject alternative name; `off` (default): "
        "not offered",
    )
    admin_port: int = Field(ADMIN_PORT, ge=0, le=65535, description="Admin HTTP port")
    data_dir: Path = Field(Path("./twinmq-data"), description="Journal and state directory")
    admin_token: SecretStr | None = Field(
        None, description="Bearer token for the admin API (required for all but healthz/readyz)"
    )
    admin_tls_cert: Path | None = Field(
        None,
        description="PEM certificate (chain): the admin API answers HTTPS only; reloaded when "
        "the file changes",
    )
    admin_tls_key: Path | None = Field(None, description="PEM private key of --admin-tls-cert")
    admin_read_token: SecretStr | None = Field(
        None,
        description="Bearer token that may only read the admin API (GET /status, /metrics: "
        "for monitoring), never change a role",
    )
    users_file: Path | None = Field(
        None, description="JSON users file; without it only guest/guest over loopback"
    )
    frame_max: int = Field(131072, ge=4096, description="Largest frame offered in tune")
    channel_max: int = Field(2047, ge=1, le=65535, description="Most channels per connection")
    heartbeat: int = Field(60, ge=0, description="Heartbeat interval offered in tune (s)")
    max_message_size: int = Field(
        128 * 1024 * 1024, ge=1, description="Largest message body accepted (bytes)"
    )
    max_connections: int = Field(
        0, ge=0, description="Client connections at most; more are closed at once (0: no limit)"
    )
    max_connections_per_user: int = Field(
        0,
        ge=0,
        description="Open client connections per user at most; more are refused at "
        "connection.open with 530 (0: no limit)",
    )
    max_queues: int = Field(
        0,
        ge=0,
        description="Queues at most per vhost; a declare beyond is refused with 406 (0: no limit)",
    )
    max_queue_length: int = Field(
        0,
        ge=0,
        description="Ready messages at most in any client queue (the broker's ceiling over "
        "each queue's own x-max-length); a publish beyond is refused as by reject-publish, "
        "never dropping one (0: no limit)",
    )
    max_queue_length_bytes: int = Field(
        0,
        ge=0,
        description="Ready messages' body bytes at most in any client queue (the ceiling over "
        "x-max-length-bytes); a publish beyond is refused likewise (0: no limit)",
    )
    segment_bytes: int = Field(
        64 * 1024 * 1024, ge=4096, description="Journal segment size before rolling over"
    )
    fsync: bool = Field(
        True, description="fdatasync the journal before confirming (never off in production)"
    )
    disk_free_limit: int = Field(
        50 * 1024 * 1024, ge=0, description="Block publishers when free disk drops below (bytes)"
    )
    memory_high_watermark: float = Field(
        0.4, gt=0, le=1, description="Block publishers above this fraction of system memory"
    )
    log_level: str = Field("INFO", description="Python logging level")
    role: Role = Field(ACTIVE, description="Start as the active broker or as a passive replica")
    replicate_from: str | None = Field(
        None, description="HOST:PORT of the active's replication listener (passive role)"
    )
    peer: str | None = Field(
        None,
        min_length=1,
        description="HOST[:PORT] of the pair's other broker (hardened mode): a passive "
        "replicates only from it (--replicate-from and POST /role's replicate_from must name "
        "this host, or an address it resolves to, and this port if given: else 403), and "
        "with --replication-tls-* each end accepts only a certificate that names this host "
        "(or --replication-tls-server-name when given). "
        "Unset: any address is accepted (the unhardened mode)",
    )
    epoch: int = Field(0, ge=0, description="Start-up epoch (the persisted one wins if higher)")
    replication_port: int = Field(
        REPLICATION_PORT,
        ge=0,
        le=65535,
        description="Replication listener port (passives connect here)",
    )
    replication_token: SecretStr | None = Field(
        None, description="Shared secret of the replication link (default: the admin token)"
    )
    replication_tls_cert: Path | None = Field(
        None,
        description="PEM certificate (chain) of this broker on the replication link; with "
        "--replication-tls-key and --replication-tls-ca the link is mutual TLS: each end "
        "presents a certificate the CA signed that names it (--name among its DNS names), "
        "in addition to the token; reloaded when the files change",
    )
    replication_tls_key: Path | None = Field(
        None, description="PEM private key of --replication-tls-cert"
    )
    replication_tls_ca: Path | None = Field(
        None, description="PEM CA bundle that signed both brokers' replication certificates"
    )
    replication_tls_mode: Literal["required", "tls-listener", "plain-listener"] = Field(
        "required",
        description="With --replication-tls-*: `required` (TLS both ways), or a step of moving "
        "a running pair to it without a window it cannot pair in: `plain-listener` (the "
        "listener takes plaintext; the passive dials TLS and, refused, plaintext) then "
        "`tls-listener` (the listener takes TLS only; the passive still falls back)",
    )
    replication_tls_server_name: str | None = Field(
        None,
        min_length=1,
        description="The name the passive checks the active's replication certificate for, "
        "instead of the address it dials (the operator dials pod IPs: it names the other "
        "broker's pod)",
    )
    dedup_window: int = Field(
        100_000,
        ge=0,
        description="Message ids remembered for duplicate detection, per vhost (0: off)",
    )
    audit: bool = Field(True, description="Write the audit log of replication events")
    audit_segment_seconds: float = Field(
        60.0, gt=0, description="Close an audit segment after this many seconds"
    )
    dedup_scope: Literal["opt-in", "all"] = Field(
        "opt-in",
        description="Drop re-sent message ids for clients that opt in (client property "
        "x-twinmq-deduplicate), or for all clients",
    )
    lease_name: str | None = Field(
        None, description="Kubernetes Lease the active broker renews (in a pod; else unused)"
    )
    lease_namespace: str | None = Field(
        None, description="Namespace of the Lease (default: the pod's own)"
    )
    lease_seconds: float = Field(
        6.0,
        gt=1,
        description="Lease duration; an active that cannot renew for this long fences itself",
    )
    replication_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds a silent passive may hold up confirms before the "
        "active goes on alone (degraded)",
    )
    replication_handshake_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a replication peer has to complete the whole authentication "
        "handshake before the connection is closed",
    )
    replication_max_connections: int = Field(
        4,
        ge=1,
        description="Most replication connections at once, authenticated or not (more are "
        "closed at once)",
    )
    max_epoch_jump: int = Field(
        1000,
        ge=1,
        description="Largest epoch increase believed from an authenticated peer (a bigger "
        "jump is refused and reported)",
    )
    catchup_chunk_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Active: bytes of messages per catch-up chunk sent to a passive "
        "(each journaled and acknowledged on its own)",
    )
    catchup_max_rate: int = Field(
        0,
        ge=0,
        description="Active: bytes per second at most for a catch-up (0: no cap); a cap "
        "keeps CPU for the active's clients while a big backlog is sent",
    )
    mirror_to: str | None = Field(
        None,
        description="HOST:PORT of a DR mirror's mirror listener: mirror every durable change "
        "there (docs/mirror.md); a bidirectional site may name several (the flag repeated, "
        "a list in the settings file, comma-separated in the environment): a full mesh, "
        "each target with its own cursor, only this site's own events sent",
    )
    mirror_token: SecretStr | None = Field(
        None, description="Shared secret of the mirror link (the same on both sites)"
    )
    mirror_id: str | None = Field(
        None,
        max_length=200,
        description="This site's origin id in mirror events (default: the broker name; give "
        "both brokers of a pair the same id)",
    )
    mirror_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Mirror side: accept mirror links from DR sources on this port (off if unset)",
    )
    mirror_max_lag: float = Field(
        30.0,
        ge=0,
        description="Block publishers while the oldest unmirrored event is older than this "
        "(seconds) and the mirror is connected and acknowledging (0: never)",
    )

    mirror_role: Literal["source", "replica", "bidirectional"] | None = Field(
        None,
        description="This site's first DR role: source (writable, mirrors to --mirror-to) or "
        "replica (read-only, applies from --mirror-port); default: source with --mirror-to "
        "alone, replica with --mirror-port alone; required with both (a site that can "
        "switch over). After a switch the role recorded in the journal wins. bidirectional: "
        "both ends at once (writable, applies from --mirror-port and "
        "mirrors its own and the applied changes to --mirror-to; every site of the ring "
        "runs it; no switchover)",
    )
    mirror_tls_cert: Path | None = Field(
        None,
        description="PEM certificate (chain) of this site on the mirror link, for client and "
        "server use: presented when it dials --mirror-to and by its --mirror-port listener; "
        "with --mirror-tls-key and --mirror-tls-ca the link is mutual TLS in addition to the "
        "token (a source's certificate must name its --mirror-id, the listener's the name the "
        "source dials); reloaded when the files change",
    )
    mirror_tls_key: Path | None = Field(None, description="PEM private key of --mirror-tls-cert")
    mirror_tls_ca: Path | None = Field(
        None,
        description="PEM CA bundle of the other site(s): verifies the mirror listener a "
        "source dials and the certificate a source presents (the sites' CAs differ)",
    )
    mirror_tls_server_name: str | None = Field(
        None,
        min_length=1,
        description="The name a source checks the mirror listener's certificate for, "
        "instead of the host of --mirror-to",
    )
    mirror_retention_events: int = Field(
        0,
        ge=0,
        description="Most unacknowledged events the replication queue keeps; beyond it the "
        "source drops its backlog and reports NeedsResync (0: no bound)",
    )

    server_id: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="This server's identifier among federated servers, unique across the "
        "federation (default: the broker name; give both brokers of a pair the same id; "
        "when set, server-named queues are amq.gen-<id>.<random>; docs/federation.md)",
    )
    federation_config: Path | None = Field(
        None,
        description="YAML or JSON file of upstreams and federated exchanges: this broker "
        "federates them as a downstream (docs/federation.md)",
    )

    @field_validator("mirror_to", mode="before")
    @classmethod
    def _mirror_targets(cls, value: object) -> object:
        """Several targets (a repeated flag, a list in the settings file) as one
        comma-separated value, the environment's form."""
        if isinstance(value, list | tuple):
            return ",".join(str(v).strip() for v in value if str(v).strip()) or None
        return value

    @property
    def mirror_targets(self) -> list[str]:
        """The `--mirror-to` addresses, in order, each once (empty: no source side)."""
        if not self.mirror_to:
            return []
        return list(dict.fromkeys(t.strip() for t in self.mirror_to.split(",") if t.strip()))

    @property
    def mirror_mesh(self) -> bool:
        """A full-mesh member: bidirectional with several targets (docs/mirror.md, "Full
        mesh"): each target has its own cursor, and only this site's own events are sent
        (nothing forwarded)."""
        return self.mirror_role == "bidirectional" and len(self.mirror_targets) > 1

    @model_validator(mode="after")
    def _mirror_roles(self) -> BrokerSettings:
        """A mirror link needs its token; a site with both ends names its first role."""
        if (self.mirror_to or self.mirror_port is not None) and self.mirror_token is None:
            raise ValueError("--mirror-to and --mirror-port need --mirror-token")
        if self.mirror_to and self.mirror_port is not None and self.mirror_role is None:
            # Only one end runs at a time (the role says which), or both (the
            # bidirectional mode, whose events carry their origin and hops: no loop).
            raise ValueError("--mirror-to with --mirror-port needs --mirror-role")
        if self.mirror_role == "source" and not self.mirror_to:
            raise ValueError("--mirror-role source needs --mirror-to")
        if self.mirror_role == "replica" and self.mirror_port is None:
            raise ValueError("--mirror-role replica needs --mirror-port")
        if self.mirror_role == "bidirectional" and (not self.mirror_to or self.mirror_port is None):
            raise ValueError("--mirror-role bidirectional needs --mirror-to and --mirror-port")
        if len(self.mirror_targets) > 1 and self.mirror_role != "bidirectional":
            # A one-way source's switchover drains to one mirror and hands over one token.
            raise ValueError("several --mirror-to targets need --mirror-role bidirectional")
        return self

    @field_validator("peer")
    @classmethod
    def _peer_form(cls, value: str | None) -> str | None:
        """`--peer` is HOST[:PORT]."""
        if value is not None:
            Peer.parse(value)
        return value

    @model_validator(mode="after")
    def _dedicated_replication_identity(self) -> BrokerSettings:
        """Hardened (`--peer`): the replication link has an identity of its own, not the
        admin API's (without `--replication-token` the admin token would be both)."""
        if self.peer is None:
            return self
        if self.replication_token is None:
            raise ValueError("--peer needs --replication-token (the link's own identity)")
        token = self.replication_token.get_secret_value()
        for other, flag_name in ((self.admin_token, "--admin-token"),
                                 (self.admin_read_token, "--admin-read-token")):  # fmt: skip
            if other is not None and other.get_secret_value() == token:
                raise ValueError(f"--replication-token must differ from {flag_name} with --peer")
        return self

    @property
    def replication_peer(self) -> Peer | None:
        """The pair's other broker (`--peer`), or None: the unhardened mode."""
        return None if self.peer is None else Peer.parse(self.peer)

    @property
    def replication_peer_name(self) -> str | None:
        """The name the peer's replication certificate must carry, at either end of the
        link: `--replication-tls-server-name` (the operator's: the other pod's name, while
        it dials pod IPs) else `--peer`'s host; None without `--peer`."""
        peer = self.replication_peer
        if peer is None:
            return None
        return self.replication_tls_server_name or peer.host

    @property
    def effective_server_id(self) -> str:
        """The server identifier: `--server-id`, else the broker name."""
        return self.server_id or self.name

    @property
    def effective_tls_client_certs(self) -> Literal["none", "optional", "required"]:
        """Whether AMQPS asks for client certificates: `--tls-client-certs`, else
        `required` with `--tls-ca` (its meaning before the option existed), else `none`."""
        if self.tls_client_certs is not None:
            return self.tls_client_certs
        return "required" if self.tls_ca is not None else "none"

    @property
    def mirror_first_role(self) -> Literal["source", "replica", "bidirectional"] | None:
        """The DR role this site starts in when its journal records none."""
        if self.mirror_role is not None:
            return self.mirror_role
        if self.mirror_to:
            return "source"
        return "replica" if self.mirror_port is not None else None

    @model_validator(mode="after")
    def _tls_files(self) -> BrokerSettings:
        """AMQPS needs a certificate and its key; client verification needs both too."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-ca (client certificates) needs --tls-cert and --tls-key")
        if self.tls_client_certs in ("optional", "required") and self.tls_ca is None:
            raise ValueError(
                f"--tls-client-certs {self.tls_client_certs} needs --tls-ca (the CA that "
                "verifies them)"
            )
        if self.tls_client_certs == "none" and self.tls_ca is not None:
            raise ValueError("--tls-client-certs none with --tls-ca: the CA would not be used")
        if self.tls_federation_ca is not None and self.effective_tls_client_certs == "none":
            raise ValueError(
                "--tls-federation-ca needs client certificates verified: --tls-ca (and "
                "--tls-client-certs optional or required)"
            )
        if self.tls_cert_login != "off" and self.effective_tls_client_certs == "none":
            raise ValueError(
                f"--tls-cert-login {self.tls_cert_login} needs client certificates verified: "
                "--tls-ca (and --tls-client-certs optional or required)"
            )
        if (self.admin_tls_cert is None) != (self.admin_tls_key is None):
            raise ValueError("--admin-tls-cert and --admin-tls-key go together")
        replication = (self.replication_tls_cert, self.replication_tls_key, self.replication_tls_ca)
        if any(f is None for f in replication) and any(f is not None for f in replication):
            raise ValueError(
                "--replication-tls-cert, --replication-tls-key and --replication-tls-ca go "
                "together (mutual TLS needs all three)"
            )
        mirror = (self.mirror_tls_cert, self.mirror_tls_key, self.mirror_tls_ca)
        if any(f is None for f in mirror) and any(f is not None for f in mirror):
            raise ValueError(
                "--mirror-tls-cert, --mirror-tls-key and --mirror-tls-ca go together "
                "(mutual TLS needs all three)"
            )
        return self


# Flags that may be given several times (their values make a list).
REPEATABLE = frozenset({"mirror_to"})


def flag(field: str) -> str:
    """The command-line flag of a settings field (`data_dir` -> `--data-dir`)."""
    return "--" + field.replace("_", "-")


def parse_args(argv: list[str] | None = None) -> BrokerSettings:
    """Build settings from flags over environment over the settings file over defaults."""
    parser = argparse.ArgumentParser(
        prog="twinmq-broker",
        description="TwinMQ AMQP 0-9-1 broker",
        epilog="tools: `twinmq-broker journal check|repair <data-dir>` (docs/journal.md), "
        "`twinmq-broker epoch show|set <data-dir>` (docs/replication.md)",
    )
    parser.add_argument("--config", help=f"JSON settings file (also {CONFIG_ENV})")
    for field, info in BrokerSettings.model_fields.items():
        if info.annotation is bool:
            parser.add_argument(
                flag(field),
                dest=field,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=info.description,
            )
        elif field in REPEATABLE:
            parser.add_argument(
                flag(field), dest=field, default=None, action="append", help=info.description
            )
        else:
            parser.add_argument(flag(field), dest=field, default=None, help=info.description)
    args = parser.parse_args(argv)
    file_values: dict[str, Any] = {}
    config = args.config or os.environ.get(CONFIG_ENV)
    if config:
        file_values = json.loads(Path(config).read_text())
    flags = {k: v for k, v in vars(args).items() if k != "config" and v is not None}
    env = BrokerSettings()  # environment over defaults
    env_set = env.model_fields_set
    merged = {**file_values, **{k: getattr(env, k) for k in env_set}, **flags}
    return BrokerSettings.model_validate(merged)
