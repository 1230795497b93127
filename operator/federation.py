"""Exchange federation on Kubernetes: what a BrokerCluster's `spec.federation` asks of its
pods, and what its status says of the links (docs/federation.md, "Operator").

Both brokers of the pair take one server identifier (`--server-id`, default
`<namespace>.<name>`): a pair is one server to its peers, as its virtual IP is one
address. The federation file the brokers read (`--federation-config`) is rendered into a
ConfigMap; upstream passwords never go into it nor onto a command line: each is a Secret
key mounted as a file, which the broker re-reads at every connection attempt (a rotated
Secret is picked up without a restart). The file's hash is part of the pod template, so a
change of `spec.federation` rolls out like any other spec change (the broker reads the
file at start-up only). Links run on the active broker; the status is its `GET /status`.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from twinmq.broker.api import FederationLinkStatus, FederationStatus
from twinmq.broker.federation.config import FederatedExchange as FileExchange
from twinmq.broker.federation.config import FederationConfig
from twinmq.broker.federation.config import Upstream as FileUpstream
from twinmq.broker.names import AMQP_PORT, AMQPS_PORT
from twinmq.operator.models import (
    Federation,
    FederationLinkState,
    FederationLinkStateName,
    FederationState,
    FederationUpstream,
    FederationUpstreamTls,
    SecretKeyReference,
)

Obj = dict[str, Any]
CONFIG_DIR = "/etc/twinmq/federation"
CONFIG_KEY = "federation.yaml"
PASSWORD_DIR = "/etc/twinmq/federation-passwords"
CONFIG_VOLUME = "federation-config"
PASSWORD_VOLUME = "federation-passwords"
TLS_DIR = "/etc/twinmq/federation-tls"  # <upstream>/ca.crt (and tls.crt, tls.key)
TLS_VOLUME = "federation-tls"
DOWNSTREAM_CA_DIR = "/etc/twinmq/federation-downstream-ca"  # ca.crt: downstreams' CAs
DOWNSTREAM_CA_VOLUME = "federation-downstream-ca"
CONFIG_HASH = "twinmq.io/federation-config-hash"
"""Pod annotation: the hash of the federation file the pod was started with."""
STATES: dict[str, FederationLinkStateName] = {
    "running": "Running",
    "connecting": "Connecting",
    "refused": "Refused",
}


def server_id(federation: Federation, namespace: str, name: str) -> str:
    """The pair's server identifier: the spec's, else `<namespace>.<name>` (unique among
    the BrokerClusters of one Kubernetes cluster)."""
    return federation.server_id or f"{namespace}.{name}"


def config_map_name(cluster_name: str) -> str:
    """The ConfigMap holding a cluster's federation file."""
    return f"{cluster_name}-federation"


def password_ref(upstream: FederationUpstream) -> SecretKeyReference | None:
    """The Secret key holding an upstream's password: the spec's, or a same-namespace
    BrokerCluster's generated credentials."""
    if upstream.password_secret is not None:
        return upstream.password_secret
    ref = upstream.cluster_ref
    if ref is not None and ref.namespace is None:
        return SecretKeyReference(name=f"{ref.name}-auth", key="federation-password")
    return None  # the CRD refuses this; an upstream without a password logs in as given


def tls_of(upstream: FederationUpstream) -> FederationUpstreamTls | None:
    """The upstream's TLS as the pods use it: None (plaintext) when turned off, or while
    no CA is known (a clusterRef's copy not made yet: `federationtls.effective` names it
    once it is)."""
    tls = upstream.tls
    if tls is None or not tls.enabled or tls.ca_config_map is None:
        return None
    return tls


def upstream_uri(upstream: FederationUpstream, namespace: str) -> str:
    """Where the link connects: a BrokerCluster's virtual-IP Service (it follows the
    upstream pair's failovers), or the URI given."""
    ref = upstream.cluster_ref
    if ref is None:
        assert upstream.uri is not None  # the CRD requires one of them
        return upstream.uri
    host = f"{ref.name}.{ref.namespace or namespace}.svc"
    if tls_of(upstream) is not None:
        return f"amqps://{upstream.user}@{host}:{AMQPS_PORT}/"
    return f"amqp://{upstream.user}@{host}:{AMQP_PORT}/"


def tls_options(upstream: FederationUpstream) -> dict[str, Any]:
    """The federation file's `tls-*` settings of an upstream (none without `tls`: the
    file, and its hash in the pod template, stay as they were)."""
    tls = tls_of(upstream)
    if tls is None:
        return {}
    folder = Path(TLS_DIR, upstream.name)
    options: dict[str, Any] = {"tls_ca": folder / "ca.crt"}
    if tls.client_secret is not None:
        options.update(tls_cert=folder / "tls.crt", tls_key=folder / "tls.key")
    if tls.server_name is not None:
        options["tls_server_name"] = tls.server_name
    return options


def render(federation: Federation, namespace: str) -> FederationConfig:
    """The broker's federation file for `spec.federation` (validated by the broker's own
    model, so what the operator writes is what the broker accepts)."""
    upstreams = {
        u.name: FileUpstream(
            uri=upstream_uri(u, namespace),
            password_file=None if password_ref(u) is None else Path(PASSWORD_DIR, u.name),
            reconnect_max_seconds=float(u.reconnect_max_seconds),
            **tls_options(u),
        )
        for u in federation.upstreams
    }
    # The newer options are passed only when the spec sets them: the file then holds only
    # what was given (`config_text` leaves unset fields out), and its hash, in the pod
    # template, stays what it was for a spec that does not use them (no rollout).
    exchanges = [FileExchange(
        exchange=e.exchange, upstream=e.upstream, upstream_exchange=e.upstream_exchange,
        type=e.type, max_hops=e.max_hops, prefetch=e.prefetch, forward=e.forward,
        **({"global_keys": True} if e.global_keys else {}),
        **({"vhost": e.vhost} if e.vhost is not None else {}),
        **({"upstream_vhost": e.upstream_vhost} if e.upstream_vhost is not None else {}),
    ) for e in federation.exchanges]  # fmt: skip
    options: dict[str, Any] = {}
    if federation.global_key_separator is not None:
        options["global_key_separator"] = federation.global_key_separator
    if federation.status_interval_seconds is not None:
        options["status_interval_seconds"] = float(federation.status_interval_seconds)
    return FederationConfig(
        upstreams=upstreams, exchanges=exchanges, dedup_window=federation.dedup_window,
        **options,
    )  # fmt: skip


def config_text(federation: Federation, namespace: str) -> str:
    """The federation file as the ConfigMap holds it (YAML, stable order; the broker's
    defaults for what the spec leaves unset are the broker's own)."""
    rendered = render(federation, namespace).model_dump(
        by_alias=True, exclude_none=True, exclude_unset=True, mode="json"
    )
    return yaml.safe_dump(rendered, sort_keys=True)


def config_hash(federation: Federation | None, namespace: str) -> str | None:
    """A short hash of the rendered file (None without federation): in the pod template."""
    if federation is None:
        return None
    return hashlib.sha256(config_text(federation, namespace).encode()).hexdigest()[:16]


def broker_args(
    federation: Federation | None, namespace: str, name: str, amqps: bool = True
) -> list[str]:
    """The broker's federation flags (none without `spec.federation`); as an upstream with
    downstreams' CAs (and AMQPS on), client certificates optional and verified against them
    (RabbitMQ's `verify_peer` without `fail_if_no_peer_cert`: an ordinary client presents
    none and logs in with its password as before)."""
    if federation is None:
        return []
    args = [
        f"--server-id={server_id(federation, namespace, name)}",
        f"--federation-config={CONFIG_DIR}/{CONFIG_KEY}",
    ]
    if amqps and federation.downstream_ca_config_map is not None:
        args += [f"--tls-ca={DOWNSTREAM_CA_DIR}/ca.crt", "--tls-client-certs=optional"]
    return args


def volumes(federation: Federation | None, cluster_name: str, amqps: bool = True) -> list[Obj]:
    """The federation file's ConfigMap and the upstreams' password Secrets (projected into
    one directory, a file per upstream), their CAs and client certificates, and (as an
    upstream, AMQPS on) the downstreams' CAs."""
    if federation is None:
        return []
    out: list[Obj] = [{"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(cluster_name)}}]
    sources = []
    for upstream in federation.upstreams:
        ref = password_ref(upstream)
        if ref is not None:
            item = {"key": ref.key, "path": upstream.name}
            sources.append({"secret": {"name": ref.name, "items": [item]}})
    if sources:
        out.append({"name": PASSWORD_VOLUME, "projected": {"defaultMode": 0o440,
                                                           "sources": sources}})  # fmt: skip
    tls_sources: list[Obj] = []
    for upstream in federation.upstreams:
        tls = tls_of(upstream)
        if tls is None:
            continue
        name = upstream.name
        tls_sources.append({"configMap": {"name": tls.ca_config_map, "items": [
            {"key": tls.ca_key, "path": f"{name}/ca.crt"}]}})  # fmt: skip
        if tls.client_secret is not None:
            tls_sources.append({"secret": {"name": tls.client_secret, "items": [
                {"key": k, "path": f"{name}/{k}"} for k in ("tls.crt", "tls.key")]}})  # fmt: skip
    if tls_sources:
        out.append({"name": TLS_VOLUME, "projected": {"defaultMode": 0o440,
                                                      "sources": tls_sources}})  # fmt: skip
    if amqps and federation.downstream_ca_config_map is not None:
        out.append({"name": DOWNSTREAM_CA_VOLUME, "configMap": {
            "name": federation.downstream_ca_config_map,
            "items": [{"key": "ca.crt", "path": "ca.crt"}]}})  # fmt: skip
    return out


def mounts(federation: Federation | None, amqps: bool = True) -> list[Obj]:
    """Where the broker container reads them."""
    if federation is None:
        return []
    out: list[Obj] = [{"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}]
    if any(password_ref(u) is not None for u in federation.upstreams):
        out.append({"name": PASSWORD_VOLUME, "mountPath": PASSWORD_DIR, "readOnly": True})
    if any(tls_of(u) is not None for u in federation.upstreams):
        out.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
    if amqps and federation.downstream_ca_config_map is not None:
        out.append({"name": DOWNSTREAM_CA_VOLUME, "mountPath": DOWNSTREAM_CA_DIR,
                    "readOnly": True})  # fmt: skip
    return out


def config_map(federation: Federation | None, namespace: str) -> dict[str, str] | None:
    """The ConfigMap's data (None without federation)."""
    if federation is None:
        return None
    return {CONFIG_KEY: config_text(federation, namespace)}


# -- status ----------------------------------------------------------------------------------


def link_state(link: FederationLinkStatus) -> FederationLinkState:
    """One link of the active broker's report, as the status shows it."""
    state = STATES.get(link.state, "Unknown")
    return FederationLinkState(
        exchange=link.exchange,
        vhost=link.vhost,
        upstream=link.upstream,
        state=state,
        connected=state == "Running",
        upstream_server_id=link.upstream_server_id or "",
        message="" if state == "Running" else (link.error or ""),
        bindings=link.bindings,
        local_bindings=link.local_bindings,
        messages_received=link.messages_received,
        duplicates_dropped=link.duplicates_dropped,
        loops_dropped=link.loops_dropped,
        forwarded=link.messages_forwarded,
        forward_pending=link.forward_pending,
        stale_unbound=link.stale_unbound,
        upstream_epoch=None if link.upstream_state is None else link.upstream_state.epoch,
        upstream_state_seq=None if link.upstream_state is None else link.upstream_state.seq,
    )


def state_of(
    federation: Federation | None, namespace: str, name: str, seen: FederationStatus | None
) -> FederationState | None:
    """`status.federation` from the active broker's report (each link Unknown while no
    active broker answers), None without `spec.federation`."""
    if federation is None:
        return None
    if seen is None:
        links = [
            FederationLinkState(exchange=e.exchange, vhost=e.vhost or "/", upstream=e.upstream)
            for e in federation.exchanges
        ]
        state = FederationState(server_id=server_id(federation, namespace, name), links=links)
    else:
        state = FederationState(
            server_id=seen.server_id,
            links=[link_state(link) for link in seen.links],
            refused_peers=list(seen.refused_peers),
            downstream_queues=len(seen.federation_queues),
            peer_status_received=seen.peer_status_received,
            peer_status_dropped=seen.peer_status_dropped,
        )
    running = sum(1 for link in state.links if link.state == "Running")
    state.running = f"{running}/{len(state.links)}"
    state.peer_status = f"{state.peer_status_received}/{state.peer_status_dropped}"
    return state


# -- server ids unique across the BrokerClusters of this operator -----------------------------


@dataclass(frozen=True)
class Claim:
    """A BrokerCluster announcing a server id (its pods' `--server-id`)."""

    server_id: str
    created: str
    """Its creationTimestamp (RFC 3339, UTC, one format: ordered as text)."""
    name: str
    """namespace/name"""


class ServerIds:
    """The server ids of the federated BrokerClusters this operator reconciles, so a second
    cluster with the same one is told before its peers' handshakes refuse it (the seed: a
    duplicate identifier is where users lose the most time). Reconciles run in threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[str, Claim] = {}

    def claim(self, uid: str, claim: Claim) -> str:
        """Record a cluster's id; the namespace/name of the earliest other cluster created
        before it with the same id ("" if none: this one keeps it)."""
        with self._lock:
            self._claims[uid] = claim
            earlier = [
                c for u, c in self._claims.items()
                if u != uid and c.server_id == claim.server_id
                and (c.created, c.name) < (claim.created, claim.name)
            ]  # fmt: skip
        return min(earlier, key=lambda c: (c.created, c.name)).name if earlier else ""

    def forget(self, uid: str) -> None:
        """A cluster deleted, or no longer federated."""
        with self._lock:
            self._claims.pop(uid, None)


def check_server_id(
    ids: ServerIds, federation: Federation | None, state: FederationState | None,
    uid: str, namespace: str, name: str, created: str,
) -> None:  # fmt: skip
    """One reconcile's part: record the cluster's server id (forget it without
    `spec.federation`) and set `state.duplicate_of` to the earlier cluster announcing it."""
    if federation is None or state is None:
        ids.forget(uid)
        return
    claim = Claim(server_id(federation, namespace, name), created, f"{namespace}/{name}")
    state.duplicate_of = ids.claim(uid, claim)


def duplicate_message(state: FederationState) -> str:
    """Why a cluster's server id is refused (the condition's and the Event's message)."""
    return (f"server id {state.server_id} is already announced by BrokerCluster "
            f"{state.duplicate_of} (created earlier): peers will refuse this cluster's links "
            "at the handshake; give spec.federation.serverId a unique value")  # fmt: skip


def condition(state: FederationState | None) -> tuple[str, bool, str, str] | None:
    """The `Federated` condition: True while every link runs (a cluster that is only an
    upstream has none: True), False for a server id another cluster announced first, None
    without `spec.federation`."""
    if state is None:
        return None
    if state.duplicate_of:
        return ("Federated", False, "DuplicateServerId", duplicate_message(state))
    down = [link for link in state.links if link.state != "Running"]
    if not state.links:
        return ("Federated", True, "UpstreamOnly",
                f"no federated exchange here; serving as {state.server_id}")  # fmt: skip
    if not down:
        return ("Federated", True, "LinksRunning",
                f"{len(state.links)} links running as {state.server_id}")  # fmt: skip
    refused = [link for link in down if link.state == "Refused"]
    reason = "PeerRefused" if refused else "LinksDown"
    why = "; ".join(f"{_named(link)} from {link.upstream}: {link.state}"
                    + (f" ({link.message})" if link.message else "") for link in down)  # fmt: skip
    return ("Federated", False, reason, why)


def _named(link: FederationLinkState) -> str:
    """A link as conditions and Events name it: its exchange (in a vhost other than `/`,
    with the vhost: two vhosts' exchanges of one name are two links)."""
    return link.exchange if link.vhost == "/" else f"{link.exchange} (vhost {link.vhost})"


def events(old: FederationState | None, new: FederationState | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events for changes of the links: a Normal one when a
    link comes up, a Warning when it goes down or is refused (a duplicate server id), and a
    Warning for each downstream refused here (the upstream side of that refusal), and a
    Warning when another BrokerCluster announced this one's server id first."""
    if new is None:
        return []
    out: list[tuple[str, str, str]] = []
    if new.duplicate_of and (old is None or old.duplicate_of != new.duplicate_of):
        out.append(("Warning", "DuplicateServerId", duplicate_message(new)))
    before = {(ln.vhost, ln.exchange): ln for ln in (old.links if old is not None else [])}
    for link in new.links:
        was = before.get((link.vhost, link.exchange))
        if link.state == "Unknown" or (was is not None and was.state == link.state):
            continue
        if link.state == "Running":
            out.append(("Normal", "FederationLinkUp", f"{_named(link)}: the link from "
                        f"{link.upstream} ({link.upstream_server_id}) is running with "
                        f"{link.bindings} bindings"))  # fmt: skip
        elif link.state == "Refused":
            out.append(("Warning", "FederationPeerRefused", f"{_named(link)}: the link from "
                        f"{link.upstream} is refused: {link.message}"))  # fmt: skip
        elif was is not None and was.state == "Running":
            out.append(("Warning", "FederationLinkDown", f"{_named(link)}: the link from "
                        f"{link.upstream} is down: {link.message or 'reconnecting'}"))  # fmt: skip
    # A refused downstream retries (with backoff): one Event per reason, not per attempt
    # (each entry is "<peer address>: <reason>").
    seen = {_reason(r) for r in old.refused_peers} if old is not None else set()
    for reason in dict.fromkeys(_reason(r) for r in new.refused_peers):
        if reason not in seen:
            out.append(("Warning", "FederationPeerRefused", f"a downstream was refused: {reason}"))
    return out


def _reason(refusal: str) -> str:
    return refusal.split(": ", 1)[-1]
