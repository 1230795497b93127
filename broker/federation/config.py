"""The federation file (`--federation-config`): upstreams and federated exchanges.

Configured on the downstream, as the seed's interclustering configuration is: which
exchange, which upstream, which exchange there. Credentials never travel on a command
line: the upstream URI carries at most a user name, the password comes from an
environment variable or a file.
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from twinmq.broker.federation.wire import auth_mechanism

ExchangeKind = Literal["direct", "topic", "fanout", "headers"]
DEFAULT_VHOST = "/"


def _hyphenated(name: str) -> str:
    return name.replace("_", "-")


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=_hyphenated, populate_by_name=True, frozen=True
    )


class Upstream(_Model):
    """A broker (pair) to federate from: where, and how to log in."""

    uri: str = Field(
        description="amqp://USER@HOST:PORT/ (no password here); a path names the upstream's "
        "vhost, percent-encoded as RabbitMQ's URIs (amqp://HOST/tenant-a, %2F for '/'): then "
        "every exchange federated from it uses that vhost unless it says `upstream-vhost`; "
        "`?auth_mechanism=external` (amqps, with tls-cert): log in with the client "
        "certificate (SASL EXTERNAL), no user or password"
    )
    password_env: str | None = Field(None, description="Environment variable with the password")
    password_file: Path | None = Field(None, description="File whose content is the password")
    reconnect_max_seconds: float = Field(
        30.0, gt=0, description="Longest pause between two connection attempts (backoff)"
    )
    tls_ca: Path | None = Field(
        None,
        description="amqps: PEM CA bundle the upstream's certificate is verified against "
        "(default: the system's CAs); an upstream in another BrokerCluster has its own CA",
    )
    tls_cert: Path | None = Field(
        None, description="amqps: PEM client certificate, if the upstream asks for one"
    )
    tls_key: Path | None = Field(None, description="amqps: PEM private key of tls-cert")
    tls_server_name: str | None = Field(
        None,
        min_length=1,
        description="amqps: the name the upstream's certificate is checked for (default: the "
        "URI's host)",
    )

    @field_validator("uri")
    @classmethod
    def _no_password(cls, uri: str) -> str:
        parts = urlsplit(uri)
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError(f"upstream uri {uri!r}: the scheme must be amqp or amqps")
        if not parts.hostname:
            raise ValueError(f"upstream uri {uri!r} names no host")
        if parts.password is not None:
            raise ValueError(
                "an upstream uri must not carry a password: use password-env or password-file"
            )
        auth_mechanism(uri)  # a ValueError for one the link does not speak
        return uri

    @model_validator(mode="after")
    def _one_password_source(self) -> Upstream:
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("give password-env or password-file, not both")
        return self

    @model_validator(mode="after")
    def _tls_with_amqps(self) -> Upstream:
        given = (self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)
        if any(v is not None for v in given) and urlsplit(self.uri).scheme != "amqps":
            raise ValueError(f"upstream uri {self.uri!r}: tls-* settings need amqps://")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls-cert and tls-key go together")
        return self

    @model_validator(mode="after")
    def _external_with_a_certificate(self) -> Upstream:
        if self.auth_mechanism != "EXTERNAL":
            return self
        if urlsplit(self.uri).scheme != "amqps" or self.tls_cert is None:
            raise ValueError(
                f"upstream uri {self.uri!r}: auth_mechanism=external logs in with the client "
                "certificate: it needs amqps:// and tls-cert, tls-key"
            )
        if self.password_env is not None or self.password_file is not None:
            raise ValueError("auth_mechanism=external: no password-env or password-file")
        if urlsplit(self.uri).username is not None:
            raise ValueError(
                f"upstream uri {self.uri!r}: auth_mechanism=external takes the user from the "
                "certificate, the uri names none"
            )
        return self

    @property
    def auth_mechanism(self) -> str:
        """How the link logs in: PLAIN (user and password) or EXTERNAL (its certificate)."""
        return auth_mechanism(self.uri)

    def tls_context(self) -> ssl.SSLContext | None:
        """amqps: the client's TLS context, made at each connection (renewed files are read
        again: rotation); None for amqp."""
        if urlsplit(self.uri).scheme != "amqps":
            return None
        context = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def password(self) -> str | None:
        """The password, read now (a file is re-read at each connection: rotation)."""
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ValueError(f"environment variable {self.password_env} is not set")
            return value
        if self.password_file is not None:
            return self.password_file.read_text().strip()
        return None

    @property
    def vhost(self) -> str | None:
        """The vhost the URI names (`amqp://host/tenant-a`), None if it names none
        (`amqp://host` or `amqp://host/`: each federated exchange's own vhost then)."""
        path = urlsplit(self.uri).path
        return unquote(path[1:]) if len(path) > 1 else None

    def connect_uri(self, vhost: str | None = None) -> str:
        """The URI with the password filled in (for the client library only: never logged),
        opening `vhost` if given (else the URI's own path)."""
        password = self.password()
        parts = urlsplit(self.uri)
        if vhost is not None:
            parts = parts._replace(path="/" + quote(vhost, safe=""))
        if password is None:
            return self.uri if vhost is None else urlunsplit(parts)
        user = parts.username or "guest"
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
        if parts.port is not None:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def shown(self) -> str:
        """The URI as status and logs show it (never a password: there is none in it)."""
        return self.uri


class FederatedExchange(_Model):
    """A local exchange that receives what an upstream exchange routes to its bindings."""

    exchange: str = Field(min_length=1, description="The local (downstream) exchange")
    vhost: str = Field(
        DEFAULT_VHOST, min_length=1, description="The local exchange's vhost (default '/')"
    )
    upstream: str = Field(description="The name of an entry of `upstreams`")
    upstream_exchange: str | None = Field(None, description="Default: the same name")
    upstream_vhost: str | None = Field(
        None,
        min_length=1,
        description="The upstream exchange's vhost: default the vhost the upstream's URI names, "
        "else the same name as `vhost`",
    )
    type: ExchangeKind = Field("topic", description="Declared here and upstream if missing")
    max_hops: int = Field(1, ge=1, description="Federation links a message may cross at most")
    prefetch: int = Field(256, ge=1, le=65535, description="Unacknowledged deliveries at most")
    forward: bool = Field(
        False,
        description="Also forward what this server's clients publish on the exchange to the "
        "upstream exchange (request-response across sites); `prefetch` bounds the "
        "unconfirmed forwards too",
    )

    global_keys: bool = Field(
        False,
        description="Global routing keys for request-response: this server's temporary "
        "queues are bound to the exchange under their global key (<server id><sep><name>; "
        "a server-named queue's own name) and a `reply-to` naming one, on a message a client "
        "publishes here, is made global; direct and topic exchanges",
    )

    @model_validator(mode="after")
    def _global_keys_routable(self) -> FederatedExchange:
        if self.global_keys and self.type not in ("direct", "topic"):
            raise ValueError(
                f"exchange {self.exchange!r}: global-keys needs a direct or topic exchange "
                f"(a {self.type} exchange does not route by the routing key)"
            )
        return self

    @property
    def source_exchange(self) -> str:
        """The exchange on the upstream."""
        return self.upstream_exchange or self.exchange

    def source_vhost(self, upstream: Upstream) -> str:
        """The upstream exchange's vhost: `upstream-vhost`, else the URI's, else ours."""
        return self.upstream_vhost or upstream.vhost or self.vhost

    @property
    def link_id(self) -> str:
        """The link's name among the server's links (dedup marks, metrics labels, logs):
        the exchange's name in `/` (as before vhosts), else the JSON list [vhost, exchange]:
        two vhosts' exchanges of one name are two links, and no federated exchange of `/`
        is named so (the link's client takes only the spec's name characters, no `[`)."""
        if self.vhost == DEFAULT_VHOST:
            return self.exchange
        return json.dumps([self.vhost, self.exchange])


class FederationConfig(_Model):
    """The whole federation file."""

    upstreams: dict[str, Upstream] = Field(default_factory=dict)
    exchanges: list[FederatedExchange] = Field(default_factory=list)
    dedup_window: int = Field(
        100_000,
        ge=1,
        description="(origin, sequence) keys remembered (one window per server); older keys a"
        " lagging link has not passed are kept a bit per seq, up to a span of 10,000x",
    )
    status_interval_seconds: float = Field(
        30.0,
        ge=0,
        description="A link-status message per link on amq.peer this often (0: none)",
    )
    global_key_separator: str = Field(
        ".",
        min_length=1,
        max_length=8,
        pattern=r"^[A-Za-z0-9\-_.:]+$",
        description="Between the server id and the local name in a global routing key "
        "(and in server-named queues, amq.gen-<server id><sep><token>)",
    )

    @model_validator(mode="after")
    def _references(self) -> FederationConfig:
        seen: set[tuple[str, str]] = set()
        # One link queue per (upstream, its vhost, its exchange): two local exchanges
        # federating the same one would share it, each taking the other's messages.
        sources: dict[tuple[str, str, str], FederatedExchange] = {}
        for fed in self.exchanges:
            if fed.upstream not in self.upstreams:
                raise ValueError(
                    f"exchange {fed.exchange!r} names upstream {fed.upstream!r}, which is not "
                    f"among the upstreams ({', '.join(sorted(self.upstreams)) or 'none'})"
                )
            if (fed.vhost, fed.exchange) in seen:
                where = "" if fed.vhost == DEFAULT_VHOST else f" in vhost {fed.vhost!r}"
                raise ValueError(f"exchange {fed.exchange!r}{where} is federated twice")
            seen.add((fed.vhost, fed.exchange))
            source = (
                fed.upstream,
                fed.source_vhost(self.upstreams[fed.upstream]),
                fed.source_exchange,
            )
            other = sources.get(source)
            if other is not None:
                raise ValueError(
                    f"exchanges {other.exchange!r} (vhost {other.vhost!r}) and {fed.exchange!r} "
                    f"(vhost {fed.vhost!r}) both federate exchange {source[2]!r} of upstream "
                    f"{source[0]!r} in its vhost {source[1]!r}: they would share one link queue"
                )
            sources[source] = fed
        return self


class FederationConfigError(ValueError):
    """The federation file cannot be read or is invalid (the message says where and why)."""


def load(path: Path) -> FederationConfig:
    """Read and validate a federation file (YAML or JSON: YAML reads both)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FederationConfigError(f"federation config {path}: {exc}") from exc
    try:
        return FederationConfig.model_validate(raw or {})
    except ValidationError as exc:
        # Without the input values: a rejected URI may hold a password.
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or '(top)'}: {error['msg']}"
            for error in exc.errors(include_input=False, include_url=False)
        )
        raise FederationConfigError(f"federation config {path}: {problems}") from None
