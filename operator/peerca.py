"""The other DR site's CA, learned by the operator instead of copied by hand (issues 14 and
16: mutual TLS on the mirror link by default).

A site verifies the other site's mirror certificate against that site's CA. When
`spec.mirror.target.host` names a BrokerCluster's virtual-IP Service in this Kubernetes
cluster (`<name>.<namespace>.svc[.cluster.local]`) and the operator may read it, the
operator copies that cluster's published CA (`<name>-ca`, key `ca.crt`) into a ConfigMap
of its own in this namespace, `<cluster>-mirror-peer-ca`, keeps it current (the other CA's
rotation publishes a new bundle there: read again every `READ_EVERY` seconds) and uses it
as if `spec.mirror.tls.caConfigMap` named it. An explicit `caConfigMap` wins. A full mesh
(`spec.mirror.targets`) needs every target's CA (its brokers run all links over TLS or
none): each target is judged so, and the copy is their bundle.

The link only comes up when both sites agree, so a site turns TLS on by itself only when
the other site will too: the other BrokerCluster names this one as its target and has a
mirror certificate (a `caConfigMap` given to the other site does not count: it may not
hold this site's CA). Both operators judge the same facts, so two sites naming each other
move together. A site that cannot learn the other's
CA (another Kubernetes cluster, a namespace the operator may not read, a replica naming no
target, a ring of three) stays plaintext with the reason `PeerCAUnknown` and the fix
(`kubectl twinmq mirror trust`) in its `MirrorTls` condition.

Once copied, the copy is kept when the other site cannot be read for a while (the API
server's answer, RBAC, the other cluster deleted and recreated): a pass that cannot read it
must not roll both brokers back to plaintext. A change of spec (TLS off, the target no
longer a BrokerCluster naming this one) does turn it off.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from twinmq.operator import mirroring
from twinmq.operator.builders import ClusterRef, owned_meta
from twinmq.operator.kube import Foreign, owned
from twinmq.operator.models import BrokerClusterSpec
from twinmq.operator.ownership import Owner

Obj = dict[str, Any]
CA_KEY = "ca.crt"
READ_EVERY = 10.0  # seconds between reads of the other site's CA (a rotation arrives then)
GROUP_VERSION = "twinmq.io/v1alpha1"
_SERVICE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.([a-z0-9]([-a-z0-9]*[a-z0-9])?)"
                      r"\.svc(\.cluster\.local)?\.?$")  # fmt: skip

TrustReason = Literal[
    "CAConfigMap", "PeerCACopied", "PeerCAUnknown", "Disabled", "NoSiteCertificate"
]


class Reader(Protocol):
    """What learning the other site's CA reads (`operator.kube.Kube.get`)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        """An object, or None when it does not exist; raises when it cannot be read."""
        ...


@dataclass(frozen=True)
class Trust:
    """Where this site's brokers get the other site's CA, and why (the `MirrorTls`
    condition). `bundle`: the CA to copy into `config_map` (the operator's own copy)."""

    tls: bool
    reason: TrustReason
    message: str
    config_map: str | None = None
    bundle: str | None = None
    peer: str = ""  # `<namespace>/<name>` of the other BrokerCluster(s), when known
    kept: bool = False  # the last copy, kept while the other site cannot be read


def config_map_name(cluster_name: str) -> str:
    """The operator's copy of the other site's CA."""
    return f"{cluster_name}-mirror-peer-ca"


def service_of(host: str) -> tuple[str, str] | None:
    """(namespace, name) of the BrokerCluster whose virtual-IP Service `host` names, or
    None for any other address (another Kubernetes cluster, an IP, a bare name)."""
    found = _SERVICE.match(host.lower())
    return None if found is None else (found.group(3), found.group(1))


def _names(spec: BrokerClusterSpec, namespace: str, name: str) -> bool:
    """Whether `spec`'s mirror target (a mesh: one of them) is the BrokerCluster
    `namespace/name`."""
    targets = spec.mirror.all_targets() if spec.mirror is not None else []
    return any(service_of(target.host) == (namespace, name) for target in targets)


def _trust_cmd(cluster: ClusterRef) -> str:
    return (f"`kubectl twinmq mirror trust {cluster.name} -n {cluster.namespace} "
            "--from-context CTX --from-namespace NS --from-cluster NAME`, or set "
            "spec.mirror.tls.caConfigMap to a copy of the other site's `<cluster>-ca`")  # fmt: skip


def copied_bundle(cluster: ClusterRef, reader: Reader) -> str | None:
    """The CA bundle in this site's copy (None: no copy, or it cannot be read now)."""
    try:
        name = config_map_name(cluster.name)  # someone else's under it is no copy (`owned`)
        mine = owned(reader.get("v1", "ConfigMap", cluster.namespace, name), Owner(cluster.uid))
    except Exception:
        return None
    return ((mine or {}).get("data") or {}).get(CA_KEY) or None


def resolve(cluster: ClusterRef, spec: BrokerClusterSpec, reader: Reader) -> Trust | None:
    """Where the other site's CA comes from for this pass (None without `spec.mirror`)."""
    mirror = spec.mirror
    if mirror is None:
        return None
    if not mirror.tls.enabled:
        return Trust(False, "Disabled", "spec.mirror.tls.enabled is false: the link runs "
                     "plaintext with its token")  # fmt: skip
    if not mirroring.certificate_wanted(spec):
        return Trust(False, "NoSiteCertificate", "the link runs plaintext with its token: "
                     "spec.tls is off or names a Secret of your own, so this site has no "
                     "mirror certificate (the operator's CA or spec.tls.issuerRef gives "
                     "one)")  # fmt: skip
    if mirror.tls.ca_config_map is not None:
        return Trust(True, "CAConfigMap", "mutual TLS: the other site's CA from ConfigMap "
                     f"{mirror.tls.ca_config_map} (spec.mirror.tls.caConfigMap)",
                     config_map=mirror.tls.ca_config_map)  # fmt: skip
    fix = _trust_cmd(cluster)
    targets = mirror.all_targets()
    if not targets:
        return Trust(False, "PeerCAUnknown", "plaintext: this replica names no target, so "
                     "the operator cannot learn its source's CA: name the source's Service "
                     f"in spec.mirror.target, or run {fix}")  # fmt: skip
    if len(targets) == 1:
        return _resolve_target(cluster, targets[0].host, reader, fix)
    # A full mesh: the brokers run every link over TLS or none (one --mirror-tls-ca), so
    # TLS is on only once every target's CA is known; the copy is their bundle.
    each = [_resolve_target(cluster, target.host, reader, fix) for target in targets]
    for target, trust in zip(targets, each, strict=True):
        if not trust.tls:
            return Trust(False, trust.reason, f"target {target.host}: {trust.message}",
                         peer=trust.peer)  # fmt: skip
    peers = ", ".join(trust.peer for trust in each)
    copy = config_map_name(cluster.name)
    if any(trust.kept for trust in each):
        # One target cannot be read now: the last bundle stays whole (a partial one would
        # drop a CA the brokers still verify with).
        stale = next(trust for trust in each if trust.kept)
        return dataclasses.replace(stale, peer=peers)
    bundle = "".join(f"{(trust.bundle or '').rstrip()}\n" for trust in each)
    return Trust(True, "PeerCACopied", f"mutual TLS: the CAs of {peers} (a mesh) copied "
                 f"into {copy} by the operator", config_map=copy, bundle=bundle,
                 peer=peers)  # fmt: skip


def _resolve_target(cluster: ClusterRef, host: str, reader: Reader, fix: str) -> Trust:
    """The CA of one target: copied when `host` is the Service of a BrokerCluster here
    that names this site back and publishes its CA."""
    where = service_of(host)
    if where is None:
        return Trust(False, "PeerCAUnknown", f"plaintext: {host} is not a "
                     "BrokerCluster's Service in this Kubernetes cluster (<name>.<namespace>"
                     f".svc), so the operator cannot read its CA: run {fix}")  # fmt: skip
    namespace, name = where
    peer = f"{namespace}/{name}"
    copy = config_map_name(cluster.name)

    def kept(why: str) -> Trust:
        """The last copy, if there is one: a read that fails does not roll the pods."""
        bundle = copied_bundle(cluster, reader)
        if bundle:
            return Trust(True, "PeerCACopied", f"mutual TLS with the last copy of {peer}'s "
                         f"CA in ConfigMap {copy} ({why})", config_map=copy, bundle=bundle,
                         peer=peer, kept=True)  # fmt: skip
        return Trust(False, "PeerCAUnknown", f"plaintext: {why}; or run {fix}", peer=peer)

    try:
        other = reader.get(GROUP_VERSION, "BrokerCluster", namespace, name)
    except Exception as exc:
        return kept(f"the operator cannot read BrokerCluster {peer} ({_short(exc)}): the "
                    "chart's RBAC scope decides which namespaces it reads")  # fmt: skip
    if other is None:
        return kept(f"no BrokerCluster {peer} (the target's Service names one)")
    try:
        other_spec = BrokerClusterSpec.model_validate(dict(other.get("spec") or {}))
    except ValidationError:
        return kept(f"BrokerCluster {peer}'s spec does not parse here")
    other_mirror = other_spec.mirror
    if other_mirror is None or not mirroring.certificate_wanted(other_spec):
        return Trust(False, "PeerCAUnknown", f"plaintext: BrokerCluster {peer} has no mirror "
                     "certificate (no spec.mirror, spec.mirror.tls.enabled false, or spec.tls "
                     "off or of your own): it would not speak TLS", peer=peer)  # fmt: skip
    if not _names(other_spec, cluster.namespace, cluster.name):
        return Trust(False, "PeerCAUnknown", f"plaintext: BrokerCluster {peer} does not name "
                     f"this site ({cluster.name}.{cluster.namespace}.svc) as its "
                     "spec.mirror.target (or one of its targets), so it cannot learn this site's "
                     "CA and would not "
                     "speak TLS: name this site there (a switchable replica does), or give "
                     f"both sites a caConfigMap: {fix}", peer=peer)  # fmt: skip
    try:  # published by the other BrokerCluster's operator, or not its CA
        owner = Owner(str((other.get("metadata") or {}).get("uid")))
        published = owned(reader.get("v1", "ConfigMap", namespace, f"{name}-ca"), owner)
    except Foreign as exc:
        return kept(str(exc))
    except Exception as exc:
        return kept(f"the operator cannot read ConfigMap {namespace}/{name}-ca "
                    f"({_short(exc)})")  # fmt: skip
    bundle = ((published or {}).get("data") or {}).get(CA_KEY)
    if not bundle:
        return kept(f"{peer} has not published its CA yet (ConfigMap {namespace}/{name}-ca)")
    return Trust(True, "PeerCACopied", f"mutual TLS: {peer}'s CA copied from ConfigMap "
                 f"{namespace}/{name}-ca into {copy} by the operator", config_map=copy,
                 bundle=bundle, peer=peer)  # fmt: skip


def _short(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status}" if status is not None else type(exc).__name__


def effective(spec: BrokerClusterSpec, trust: Trust | None) -> BrokerClusterSpec:
    """The spec the pods are built from: `caConfigMap` set to the operator's copy when it
    has one (the pods mount it and run the link over mutual TLS, `mirroring.tls_on`)."""
    mirror = spec.mirror
    if (
        mirror is None
        or trust is None
        or trust.reason != "PeerCACopied"
        or mirror.tls.ca_config_map is not None
    ):
        return spec
    tls = mirror.tls.model_copy(update={"ca_config_map": trust.config_map, "ca_key": CA_KEY})
    return spec.model_copy(update={"mirror": mirror.model_copy(update={"tls": tls})})


def build_config_map(cluster: ClusterRef, trust: Trust) -> Obj | None:
    """The operator's copy of the other site's CA (owned: it goes with the cluster)."""
    if trust.reason != "PeerCACopied" or trust.bundle is None:
        return None
    meta = owned_meta(cluster, config_map_name(cluster.name))
    sources = ", ".join(f"{peer}-ca" for peer in trust.peer.split(", "))
    meta["annotations"] = {"twinmq.io/copied-from": sources}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {CA_KEY: trust.bundle}}  # fmt: skip


def condition(trust: Trust | None) -> tuple[str, bool, str, str] | None:
    """The `MirrorTls` condition: True while the brokers are built to run the link over
    mutual TLS (the active's report of the link itself is `status.mirror.tls`)."""
    if trust is None:
        return None
    return ("MirrorTls", trust.tls, trust.reason, trust.message)


def events(before: str | None, trust: Trust | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Event for a new or changed copy; `before`: the copy's
    CA as it was (None: no copy yet)."""
    if trust is None or trust.reason != "PeerCACopied" or trust.bundle is None:
        return []
    if before == trust.bundle:
        return []
    assert trust.config_map is not None
    if before is None:
        return [("Normal", "MirrorPeerCACopied", f"{trust.peer}'s CA copied into ConfigMap "
                 f"{trust.config_map}: the mirror link moves to mutual TLS (the pods "
                 "roll)")]  # fmt: skip
    return [("Normal", "MirrorPeerCAUpdated", f"{trust.peer}'s CA changed (a rotation): "
             f"ConfigMap {trust.config_map} updated; the brokers reload it")]  # fmt: skip


@dataclass
class PeerCaMemory:
    """What one operator process keeps between passes: the last answer, when it was read,
    and the CA last written into the copy (None: not known yet, read from the copy)."""

    trust: Trust | None = None
    read_at: float = float("-inf")
    written: str | None = None
    known: bool = False
    spec_key: str = ""


def reconcile(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    memory: PeerCaMemory,
    reader: Reader,
    clock: float,
    post: Callable[[str, str, str], None],
) -> Trust | None:
    """This pass's answer (read again every READ_EVERY seconds, at once after a spec change
    that affects it); posts the Event of a new or updated copy (`post(type, reason,
    message)`). The copy itself is applied with the other children (`build_config_map`)."""
    # A spec edit need not wait for the next read: it is judged now.
    key = spec.mirror.model_dump_json() if spec.mirror is not None else ""
    key += spec.tls.model_dump_json()
    if key == memory.spec_key and clock - memory.read_at < READ_EVERY:
        return memory.trust
    memory.read_at, memory.spec_key = clock, key
    trust = memory.trust = resolve(cluster, spec, reader)
    if trust is not None and trust.reason == "PeerCACopied":
        if not memory.known:
            memory.written = copied_bundle(cluster, reader)
            memory.known = True
        for kind, reason, message in events(memory.written, trust):
            post(kind, reason, message)
        memory.written = trust.bundle
    return trust
