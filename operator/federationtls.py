"""Federation over amqps between BrokerClusters of one Kubernetes cluster, set up by the
operator (issues 15 and 16; docs/federation.md, "Operator", and docs/security.md).

A downstream whose `spec.federation.upstreams[]` names another BrokerCluster
(`clusterRef`) dials it on AMQPS by default, as the mirror link does between two sites
(`operator/peerca.py`, whose approach this follows):

- **the upstream's CA, copied**: the operator reads the upstream's published CA (its
  `<name>-ca` ConfigMap, key `ca.crt`) into a ConfigMap of its own in the downstream's
  namespace, `<cluster>-federation-peer-ca` (a key per upstream, `<upstream>.crt`), read
  again every `READ_EVERY` seconds (a new CA there arrives here), and names it as if
  `tls.caConfigMap` did. An explicit `tls.caConfigMap` wins; `tls.enabled: false` keeps
  the plain port. Until a copy exists (the upstream not published yet, not readable) the
  link runs plaintext, and the `FederationTls` condition says why. Once copied, a pass that
  cannot read the upstream keeps the copy (it must not roll the pods back to plaintext);
- **a client certificate**: the downstream's own CA (operator-managed, or cert-manager
  with `spec.tls.issuerRef`) issues `<cluster>-federation-tls` (`operator/certs.py`), which
  the links present unless `tls.clientSecret` names another;
- **the upstream trusts the downstreams' CAs**: the upstream's operator pass lists the
  BrokerClusters naming it as a clusterRef upstream (the `list` verb on BrokerClusters the
  operator has to watch them) and copies their published CAs, concatenated, into
  `<cluster>-federation-downstream-ca`; its brokers then ask AMQPS clients for a
  certificate, **optional**, verified against those CAs when presented
  (`--tls-client-certs optional`): an ordinary client presents none and logs in with its
  password as before. `spec.federation.downstreamCaConfigMap` replaces the copy (a
  downstream in another Kubernetes cluster).

A verified client certificate is no login: the link still logs in with its upstream user's
password (the users file and permissions apply). With `spec.tls.clientCertificates` the
downstreams' CAs go beside the applications' bundle (`--tls-federation-ca`), never in it:
a certificate a downstream's CA signed is refused as a login (`login`), whatever it names.
What it adds is that a TLS session to the upstream's AMQPS port presenting a certificate
needs one a trusted downstream's CA signed.
The operator reads nothing it may not read: BrokerClusters and ConfigMaps, verbs it has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from twinmq.operator.builders import ClusterRef, client_certificates, owned_meta
from twinmq.operator.kube import owned
from twinmq.operator.models import (
    BrokerClusterSpec,
    FederationUpstream,
    FederationUpstreamTls,
)
from twinmq.operator.ownership import Owner

Obj = dict[str, Any]
CA_KEY = "ca.crt"
READ_EVERY = 10.0  # seconds between reads of the other clusters' CAs (a rotation arrives then)
GROUP_VERSION = "twinmq.io/v1alpha1"
COPIED_FROM = "twinmq.io/copied-from"

LinkReason = Literal["CAConfigMap", "PeerCACopied", "PeerCAUnknown", "Disabled", "NoTls"]


class Reader(Protocol):
    """What learning the other clusters' CAs reads (`operator.kube.Kube`)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        """An object, or None when it does not exist; raises when it cannot be read."""
        ...

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Obj]:
        """The objects of a kind in a namespace ("": every namespace); raises when it cannot."""
        ...


@dataclass(frozen=True)
class LinkTrust:
    """How this cluster's links reach one upstream, and why. `bundle`: the upstream's CA
    to keep in the copy (`PeerCACopied`)."""

    upstream: str
    tls: bool
    reason: LinkReason
    message: str
    bundle: str | None = None
    peer: str = ""  # `<namespace>/<name>` of the upstream BrokerCluster


@dataclass(frozen=True)
class DownstreamTrust:
    """As an upstream: the CAs whose client certificates AMQPS verifies. `bundle`: the
    copy's content (None: no copy; `config_map` then is the spec's, or there is none)."""

    message: str
    bundle: str | None = None
    downstreams: tuple[str, ...] = ()
    config_map: str | None = None


@dataclass(frozen=True)
class Trust:
    """One pass's answer for a federated cluster."""

    links: tuple[LinkTrust, ...] = ()
    downstream: DownstreamTrust | None = None


def peer_ca_name(cluster_name: str) -> str:
    """The operator's copy of the upstreams' CAs (a key per upstream)."""
    return f"{cluster_name}-federation-peer-ca"


def downstream_ca_name(cluster_name: str) -> str:
    """The operator's copy of the downstreams' CAs (one bundle, `ca.crt`)."""
    return f"{cluster_name}-federation-downstream-ca"


def client_secret_name(cluster_name: str) -> str:
    """The federation links' client certificate."""
    return f"{cluster_name}-federation-tls"


def client_names(namespace: str, name: str) -> list[str]:
    """The DNS name in the client certificate (its common name is `<namespace>/<name>`)."""
    return [f"{name}.{namespace}.svc"]


def upstream_key(upstream: str) -> str:
    """An upstream's CA in the copy."""
    return f"{upstream}.crt"


def automatic(upstream: FederationUpstream) -> bool:
    """Whether the operator supplies this upstream's CA: a clusterRef, TLS not turned off,
    no caConfigMap given."""
    tls = upstream.tls
    return upstream.cluster_ref is not None and (
        tls is None or (tls.enabled and tls.ca_config_map is None)
    )


def presents_own_certificate(upstream: FederationUpstream) -> bool:
    """Whether the links to this upstream present `<cluster>-federation-tls`."""
    return automatic(upstream) and (upstream.tls is None or upstream.tls.client_secret is None)


def own_ca(spec: BrokerClusterSpec) -> bool:
    """Whether the cluster has a CA of its own to sign a client certificate (the
    operator's, or cert-manager's: not a Secret of your own)."""
    tls = spec.tls
    return tls.enabled and (tls.issuer_ref is not None or tls.secret_name is None)


def client_certificate_wanted(spec: BrokerClusterSpec, cluster_name: str) -> bool:
    """Whether the cluster has `<cluster>-federation-tls`: an upstream presents it, in the
    spec as written (`presents_own_certificate`) or as `effective` made it (naming it)."""
    fed = spec.federation
    if fed is None or not own_ca(spec):
        return False
    issued = client_secret_name(cluster_name)
    return any(
        presents_own_certificate(u) or (u.tls is not None and u.tls.client_secret == issued)
        for u in fed.upstreams
    )


def _short(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status}" if status is not None else type(exc).__name__


def _uid(obj: Obj) -> str:
    """A BrokerCluster's uid: the owner its published `<name>-ca` must name."""
    return str((obj.get("metadata") or {}).get("uid"))


def _data(obj: Obj | None) -> dict[str, str]:
    return dict((obj or {}).get("data") or {})


def copied(cluster: ClusterRef, name: str, reader: Reader) -> dict[str, str]:
    """A copy's data ({}: none, or it cannot be read now)."""
    try:
        return _data(
            owned(reader.get("v1", "ConfigMap", cluster.namespace, name), Owner(cluster.uid))
        )
    except Exception:
        return {}


def resolve_link(
    cluster: ClusterRef, upstream: FederationUpstream, reader: Reader, kept: dict[str, str]
) -> LinkTrust:
    """How the links reach `upstream` this pass; `kept`: the copy as it is."""
    tls, name = upstream.tls, upstream.name
    ref = upstream.cluster_ref
    if ref is None:
        if tls is not None:
            return LinkTrust(name, True, "CAConfigMap", f"{name}: amqps, its CA from ConfigMap "
                             f"{tls.ca_config_map}")  # fmt: skip
        return LinkTrust(name, False, "NoTls", f"{name}: plaintext ({upstream.uri} has no "
                         "tls: give it an amqps:// uri and tls.caConfigMap)")  # fmt: skip
    if tls is not None and not tls.enabled:
        return LinkTrust(name, False, "Disabled", f"{name}: plaintext (tls.enabled is false)")
    if tls is not None and tls.ca_config_map is not None:
        return LinkTrust(name, True, "CAConfigMap", f"{name}: amqps, its CA from ConfigMap "
                         f"{tls.ca_config_map} (tls.caConfigMap)")  # fmt: skip
    namespace = ref.namespace or cluster.namespace
    peer = f"{namespace}/{ref.name}"
    copy = peer_ca_name(cluster.name)

    def keep(why: str) -> LinkTrust:
        """The last copy, if there is one: a read that fails does not roll the pods."""
        bundle = kept.get(upstream_key(name))
        if bundle:
            return LinkTrust(name, True, "PeerCACopied", f"{name}: amqps with the last copy "
                             f"of {peer}'s CA in ConfigMap {copy} ({why})", bundle,
                             peer)  # fmt: skip
        return LinkTrust(name, False, "PeerCAUnknown", f"{name}: plaintext until the "
                         f"operator can copy its CA: {why}", peer=peer)  # fmt: skip

    try:
        other = reader.get(GROUP_VERSION, "BrokerCluster", namespace, ref.name)
    except Exception as exc:
        return keep(f"the operator cannot read BrokerCluster {peer} ({_short(exc)}): the "
                    "chart's RBAC scope decides which namespaces it reads; or give "
                    "tls.caConfigMap")  # fmt: skip
    if other is None:
        return keep(f"no BrokerCluster {peer}")
    try:
        other_spec = BrokerClusterSpec.model_validate(dict(other.get("spec") or {}))
    except ValidationError:
        return keep(f"BrokerCluster {peer}'s spec does not parse here")
    if not other_spec.tls.enabled:
        return LinkTrust(name, False, "PeerCAUnknown", f"{name}: plaintext: BrokerCluster "
                         f"{peer} serves no AMQPS (its spec.tls.enabled is false)",
                         peer=peer)  # fmt: skip
    try:
        published = owned(
            reader.get("v1", "ConfigMap", namespace, f"{ref.name}-ca"), Owner(_uid(other))
        )
    except Exception as exc:
        return keep(f"the operator cannot read ConfigMap {peer}-ca ({_short(exc)})")
    bundle = _data(published).get(CA_KEY)
    if not bundle:
        return keep(f"{peer} has not published its CA (ConfigMap {peer}-ca; a Secret of "
                    "your own without ca.crt publishes none: give tls.caConfigMap)")  # fmt: skip
    return LinkTrust(name, True, "PeerCACopied", f"{name}: amqps, {peer}'s CA copied into "
                     f"ConfigMap {copy}", bundle, peer)  # fmt: skip


def names_as_upstream(item: Obj, cluster: ClusterRef) -> BrokerClusterSpec | None:
    """The spec of a listed BrokerCluster whose links present their own client certificate
    to `cluster` (None: it is not such a downstream)."""
    meta = item.get("metadata") or {}
    try:
        spec = BrokerClusterSpec.model_validate(dict(item.get("spec") or {}))
    except ValidationError:
        return None
    fed = spec.federation
    name = str(meta.get("name") or "")
    if fed is None or not client_certificate_wanted(spec, name):
        return None
    for upstream in fed.upstreams:
        ref = upstream.cluster_ref
        if (
            ref is not None
            and presents_own_certificate(upstream)
            and ref.name == cluster.name
            and (ref.namespace or meta.get("namespace")) == cluster.namespace
        ):
            return spec
    return None


def resolve_downstreams(
    cluster: ClusterRef, spec: BrokerClusterSpec, reader: Reader, kept: dict[str, str]
) -> DownstreamTrust | None:
    """As an upstream: whose client certificates AMQPS verifies (None: not federated, or
    no AMQPS)."""
    fed = spec.federation
    if fed is None or not spec.tls.enabled:
        return None
    wanted = client_certificates(spec)
    # With the applications' bundle the downstreams' CAs go beside it, for the handshake
    # only (`--tls-federation-ca`): never a login CA (builders.downstream_cas_beside); and
    # without downstreams client certificates are still asked for (the applications').
    beside = (
        "" if wanted is None else
        f" beside spec.tls.clientCertificates' bundle (mode {wanted.mode}), never a login"
    )  # fmt: skip
    none = "no client certificates asked for" if wanted is None else "no downstreams' CAs verified"
    if fed.downstream_ca_config_map is not None:
        return DownstreamTrust(
            f"client certificates verified against ConfigMap {fed.downstream_ca_config_map} "
            f"(spec.federation.downstreamCaConfigMap){beside}",
            config_map=fed.downstream_ca_config_map,
        )
    copy = downstream_ca_name(cluster.name)

    def keep(why: str) -> DownstreamTrust:
        bundle = kept.get(CA_KEY)
        if bundle:
            return DownstreamTrust(f"client certificates verified against the last copy of "
                                   f"the downstreams' CAs in ConfigMap {copy} ({why}){beside}",
                                   bundle, config_map=copy)  # fmt: skip
        return DownstreamTrust(f"{none}: {why}")

    items: list[Obj] | None = None
    failure: Exception | None = None
    # Every namespace when the operator may list there (cluster scope), else its own.
    for namespace in ("", cluster.namespace):
        try:
            items = reader.list(GROUP_VERSION, "BrokerCluster", namespace, "")
            break
        except Exception as exc:
            failure = exc
    if items is None:
        assert failure is not None
        return keep(f"the operator cannot list BrokerClusters ({_short(failure)})")
    uids = {
        "{namespace}/{name}".format(**(item.get("metadata") or {})): _uid(item)
        for item in items
        if names_as_upstream(item, cluster) is not None
    }
    found = sorted(uids)
    cas: dict[str, None] = {}
    trusted: list[str] = []
    for downstream in found:
        namespace, name = downstream.split("/", 1)
        try:
            published = owned(
                reader.get("v1", "ConfigMap", namespace, f"{name}-ca"), Owner(uids[downstream])
            )
        except Exception as exc:
            return keep(f"the operator cannot read ConfigMap {downstream}-ca ({_short(exc)})")
        ca = _data(published).get(CA_KEY)
        if ca:
            cas[ca if ca.endswith("\n") else ca + "\n"] = None
            trusted.append(downstream)
    if not cas:
        return DownstreamTrust(f"{none}: no BrokerCluster with a "
                               "CA of its own names this one as a clusterRef upstream")  # fmt: skip
    return DownstreamTrust(f"client certificates of {', '.join(trusted)} verified (their "
                           f"CAs copied into ConfigMap {copy}){beside}", "".join(cas),
                           tuple(trusted), copy)  # fmt: skip


def resolve(cluster: ClusterRef, spec: BrokerClusterSpec, reader: Reader) -> Trust | None:
    """This pass's answer (None without `spec.federation`)."""
    fed = spec.federation
    if fed is None:
        return None
    links_kept = (
        copied(cluster, peer_ca_name(cluster.name), reader)
        if any(automatic(u) for u in fed.upstreams) else {}
    )  # fmt: skip
    links = tuple(resolve_link(cluster, u, reader, links_kept) for u in fed.upstreams)
    downstream_kept = copied(cluster, downstream_ca_name(cluster.name), reader) if (
        spec.tls.enabled and fed.downstream_ca_config_map is None) else {}  # fmt: skip
    return Trust(links, resolve_downstreams(cluster, spec, reader, downstream_kept))


def effective(
    cluster: ClusterRef, spec: BrokerClusterSpec, trust: Trust | None
) -> BrokerClusterSpec:
    """The spec the pods are built from: each upstream whose CA the operator copied
    names the copy (and the client certificate it issued), and an upstream with
    downstreams' CAs names their copy (`federation.broker_args` turns client
    certificates on, optional; with the applications' bundle `builders.client_ca_args`
    passes it as `--tls-federation-ca`)."""
    fed = spec.federation
    if fed is None or trust is None:
        return spec
    copied_links = {link.upstream for link in trust.links if link.reason == "PeerCACopied"}
    upstreams = []
    for upstream in fed.upstreams:
        if upstream.name not in copied_links or not automatic(upstream):
            upstreams.append(upstream)
            continue
        given = upstream.tls or FederationUpstreamTls()
        own = client_certificate_wanted(spec, cluster.name) and given.client_secret is None
        tls = given.model_copy(update={
            "ca_config_map": peer_ca_name(cluster.name),
            "ca_key": upstream_key(upstream.name),
            "client_secret": client_secret_name(cluster.name) if own else given.client_secret,
        })  # fmt: skip
        upstreams.append(upstream.model_copy(update={"tls": tls}))
    update: dict[str, Any] = {"upstreams": upstreams}
    down = trust.downstream
    if down is not None and down.bundle is not None and fed.downstream_ca_config_map is None:
        update["downstream_ca_config_map"] = down.config_map
    return spec.model_copy(update={"federation": fed.model_copy(update=update)})


def build_config_maps(cluster: ClusterRef, trust: Trust | None) -> list[Obj]:
    """The operator's copies (owned: they go with the cluster): the upstreams' CAs it
    copied, and the downstreams' CAs."""
    if trust is None:
        return []
    out: list[Obj] = []
    links = [link for link in trust.links if link.reason == "PeerCACopied" and link.bundle]
    if links:
        meta = owned_meta(cluster, peer_ca_name(cluster.name))
        meta["annotations"] = {COPIED_FROM: ",".join(f"{link.peer}-ca" for link in links)}
        data = {upstream_key(link.upstream): link.bundle for link in links}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    down = trust.downstream
    if down is not None and down.bundle is not None:
        meta = owned_meta(cluster, downstream_ca_name(cluster.name))
        if down.downstreams:
            meta["annotations"] = {COPIED_FROM: ",".join(f"{d}-ca" for d in down.downstreams)}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                    "data": {CA_KEY: down.bundle}})  # fmt: skip
    return out


def condition(trust: Trust | None) -> tuple[str, bool, str, str] | None:
    """The `FederationTls` condition: True while every link is built to run over amqps
    (a cluster that is only an upstream: True), with what its AMQPS verifies of the
    downstreams."""
    if trust is None:
        return None
    plain = [link for link in trust.links if not link.tls]
    parts = [link.message for link in trust.links]
    if trust.downstream is not None:
        parts.append(trust.downstream.message)
    message = "; ".join(parts) or "no upstream, no AMQPS"
    if plain:
        return ("FederationTls", False, plain[0].reason, message)
    return ("FederationTls", True, "LinksTls" if trust.links else "UpstreamOnly", message)


def events(
    cluster: ClusterRef, trust: Trust | None, written: dict[str, str], written_down: str | None
) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Events for a new or changed copy; `written`: the
    upstreams' CAs as the copy held them, `written_down` the downstreams' bundle."""
    if trust is None:
        return []
    out: list[tuple[str, str, str]] = []
    for link in trust.links:
        if link.reason != "PeerCACopied" or link.bundle is None:
            continue
        was = written.get(upstream_key(link.upstream))
        if was == link.bundle:
            continue
        if was is None:
            out.append(("Normal", "FederationPeerCACopied", f"{link.peer}'s CA copied into "
                        f"ConfigMap {peer_ca_name(cluster.name)}: the links from "
                        f"{link.upstream} move to amqps (the pods roll)"))  # fmt: skip
        else:
            out.append(("Normal", "FederationPeerCAUpdated", f"{link.peer}'s CA changed (a "
                        "rotation): the copy is updated; the brokers read it at the next "
                        "connection"))  # fmt: skip
    down = trust.downstream
    if down is not None and down.bundle is not None and down.bundle != written_down:
        out.append(("Normal", "FederationDownstreamCAs", down.message))
    return out


@dataclass
class FederationTlsMemory:
    """What one operator process keeps between passes: the last answer, when it was read,
    and the copies as last written (None: not known yet, read from the copies)."""

    trust: Trust | None = None
    read_at: float = float("-inf")
    spec_key: str = ""
    written: dict[str, str] = field(default_factory=dict)
    written_down: str | None = None
    known: bool = False


def reconcile(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    memory: FederationTlsMemory,
    reader: Reader,
    clock: float,
    post: Callable[[str, str, str], None],
) -> Trust | None:
    """This pass's answer (read again every READ_EVERY seconds, at once after a spec
    change that affects it); posts the Events of new or updated copies. The copies
    themselves are applied with the other children (`build_config_maps`)."""
    key = spec.federation.model_dump_json() if spec.federation is not None else ""
    key += spec.tls.model_dump_json()
    if key == memory.spec_key and clock - memory.read_at < READ_EVERY:
        return memory.trust
    memory.read_at, memory.spec_key = clock, key
    trust = memory.trust = resolve(cluster, spec, reader)
    if trust is None:
        return None
    if not memory.known:
        memory.written = copied(cluster, peer_ca_name(cluster.name), reader)
        memory.written_down = copied(cluster, downstream_ca_name(cluster.name), reader).get(CA_KEY)
        memory.known = True
    for kind, reason, message in events(cluster, trust, memory.written, memory.written_down):
        post(kind, reason, message)
    memory.written = {
        upstream_key(link.upstream): link.bundle
        for link in trust.links if link.reason == "PeerCACopied" and link.bundle
    }  # fmt: skip
    if trust.downstream is not None and trust.downstream.bundle is not None:
        memory.written_down = trust.downstream.bundle
    return trust
