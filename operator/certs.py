"""The brokers' server certificate for AMQPS (issue 16, "Certificates").

`spec.tls` (on by default) chooses where it comes from:

- an **operator-managed CA per BrokerCluster** (neither `secretName` nor `issuerRef`): the
  operator makes a CA (`<cluster>-tls-ca`, kept ten years) and issues the brokers' server
  certificate (`<cluster>-tls`, a `kubernetes.io/tls` Secret with `ca.crt`) whose SANs
  cover the virtual-IP Service, the headless Service and both pods' names. It issues a new
  one at two thirds of its lifetime (`CERT_SECONDS_ENV`, 90 days by default), or at once
  when the names it needs changed or the CA is not its signer. The kubelet updates the
  Secret volume in place and the broker loads the new files for new handshakes without
  dropping open connections (`broker/tls.py`);
- **cert-manager** (`issuerRef`): a cert-manager `Certificate` for the same names, its
  Secret (`secretName`, default `<cluster>-tls`) mounted as is; cert-manager renews it;
- **your own Secret** (`secretName` alone): mounted as is; you renew it.

The CA certificate clients verify against is published in the ConfigMap `<cluster>-ca`
(key `ca.crt`) whenever the Secret holds a `ca.crt`.

With the managed CA or cert-manager, each broker also has a certificate of its own,
`<cluster>-<broker>-tls` (server and client use, naming its pod only: `peer_names`), for the
replication link's mutual TLS and the admin API's HTTPS (`operator/peertls.py`), issued and
renewed the same way.

A mirrored site (`spec.mirror`, TLS not turned off) has one more, `<cluster>-mirror-tls`:
the site's identity on the DR mirror link (`operator/mirroring.py`), for client and server
use, its common name the site's origin (`<namespace>/<name>`), its DNS names the
virtual-IP Service's (and `spec.mirror.tls.serverNames`).

A downstream of federation over amqps (a `clusterRef` upstream, TLS not turned off) has
`<cluster>-federation-tls`: the client certificate its links present upstream
(`operator/federationtls.py`), its common name the cluster's `<namespace>/<name>`.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from twinmq.broker.names import ENV_PREFIX
from twinmq.operator import carotation, federationtls, mirroring
from twinmq.operator.builders import (
    ClusterRef,
    owned_meta,
    peer_secret_name,
    pod_name,
    tls_secret_name,
    vip_name,
)
from twinmq.operator.models import BrokerClusterSpec, BrokerName, CaRotation, Tls
from twinmq.operator.ownership import Owner

log = logging.getLogger(__name__)
Obj = dict[str, Any]

CERT_SECONDS_ENV = ENV_PREFIX + "OPERATOR_CERT_SECONDS"
"""Operator setting: the lifetime of the server certificates it issues (default 90 days)."""
DEFAULT_CERT_SECONDS = 90 * 86400
MIN_CERT_SECONDS = 30  # tests prove renewal with a lifetime of seconds
CA_SECONDS = 10 * 365 * 86400
RENEW_FRACTION = 2 / 3
"""A certificate is renewed when this much of its lifetime has passed (cert-manager's
default too)."""
BACKDATE = timedelta(minutes=5)  # clocks a little behind the operator's still accept it
BROKERS: tuple[BrokerName, ...] = ("primary", "backup")
READ_EVERY = 30.0
"""Seconds between reads of a Secret the operator does not issue (for its `ca.crt`)."""


def cert_seconds(env: Mapping[str, str] = os.environ) -> int:
    """$TWINMQ_OPERATOR_CERT_SECONDS, or 90 days; refused below 30 s."""
    raw = env.get(CERT_SECONDS_ENV, "").strip()
    if not raw:
        return DEFAULT_CERT_SECONDS
    seconds = int(raw)
    if seconds < MIN_CERT_SECONDS:
        raise ValueError(f"{CERT_SECONDS_ENV}={seconds}: at least {MIN_CERT_SECONDS}")
    return seconds


def ca_secret_name(cluster: ClusterRef) -> str:
    """The operator-managed CA's Secret (its key never leaves it)."""
    return f"{cluster.name}-tls-ca"


def ca_config_map_name(cluster: ClusterRef) -> str:
    """The ConfigMap publishing the CA certificate for clients."""
    return f"{cluster.name}-ca"


def peer_names(cluster: ClusterRef, broker: BrokerName) -> list[str]:
    """The names of one broker's own certificate: its pod's (the name it claims on the
    replication link, `--name`) short and through the headless Service; not the other
    broker's, not the virtual IP's."""
    pod, headless, ns = pod_name(cluster, broker), f"{cluster.name}-brokers", cluster.namespace
    qualified = f"{pod}.{headless}"
    return [pod, qualified, f"{qualified}.{ns}", f"{qualified}.{ns}.svc",
            f"{qualified}.{ns}.svc.cluster.local"]  # fmt: skip


def dns_names(cluster: ClusterRef) -> list[str]:
    """Every name a client may reach a broker by: the virtual IP's (what applications
    use), the headless Service's and each pod's, short and qualified."""

    def forms(name: str) -> list[str]:
        ns = cluster.namespace
        return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]

    headless = f"{cluster.name}-brokers"
    names = forms(vip_name(cluster)) + forms(headless)
    for broker in BROKERS:
        pod = pod_name(cluster, broker)
        names += [pod, *forms(f"{pod}.{headless}")]
    return names


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key."""

    cert: str
    key: str

    def certificate(self) -> x509.Certificate:
        """The parsed certificate."""
        return x509.load_pem_x509_certificate(self.cert.encode())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def new_ca(cluster: ClusterRef, now: datetime) -> KeyPair:
    """A CA of this BrokerCluster only (it signs server certificates, nothing below)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(
        NameOID.COMMON_NAME, f"TwinMQ {cluster.namespace}/{cluster.name} CA")])  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(seconds=CA_SECONDS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))


def issue_server(
    ca: KeyPair,
    names: list[str],
    now: datetime,
    seconds: int,
    *,
    client: bool = False,
    common_name: str | None = None,
    addresses: Sequence[str] = (),
) -> KeyPair:
    """A server certificate for `names` (and IP `addresses`: tests on loopback), signed by
    `ca`, valid `seconds` from `now`; with `client`, for client use too (a broker's own:
    both ends of the replication link); its common name `common_name` (default: the first
    name)."""
    usages = [ExtendedKeyUsageOID.SERVER_AUTH]
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    ca_cert = ca.certificate()
    ca_key = serialization.load_pem_private_key(ca.key.encode(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name or names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Backdated a tenth of a short life at most: else it would be due at once.
        .not_valid_before(now - min(BACKDATE, timedelta(seconds=seconds) / 10))
        .not_valid_after(now + timedelta(seconds=seconds))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    *(x509.DNSName(n) for n in names),
                    *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM).decode(), _key_pem(key))


def renew_at(cert: x509.Certificate) -> datetime:
    """When a certificate is renewed: at `RENEW_FRACTION` of its lifetime."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * RENEW_FRACTION


def sans(cert: x509.Certificate) -> list[str]:
    """The DNS names a certificate covers."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(ext.value.get_values_for_type(x509.DNSName))


def reissue_reason(
    server: KeyPair | None, ca: KeyPair, names: list[str], now: datetime
) -> str | None:
    """Why the server certificate must be issued again (None: it is good as it is)."""
    if server is None:
        return "no server certificate yet"
    try:
        cert = server.certificate()
        cert.verify_directly_issued_by(ca.certificate())
    except (ValueError, TypeError, InvalidSignature):
        return "the server certificate is not one this cluster's CA signed"
    if sorted(sans(cert)) != sorted(names):
        return "the names the server certificate must cover changed"
    if now >= renew_at(cert):
        return f"renewal due (valid until {cert.not_valid_after_utc.isoformat()})"
    return None


def b64(data: Mapping[str, str]) -> dict[str, str]:
    """Secret `data` of text values (`data`, not `stringData`: compares equal when read back)."""
    return {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}


def _tls_secret(
    cluster: ClusterRef,
    name: str,
    cert: KeyPair,
    trust: str | None,
    broker: BrokerName | None = None,
    extra: Mapping[str, str] | None = None,
) -> Obj:
    """A `kubernetes.io/tls` Secret the BrokerCluster owns (with `ca.crt`, the trust
    bundle, as cert-manager writes it, unless it is the CA's own)."""
    data = {"tls.crt": cert.cert, "tls.key": cert.key, **(extra or {})}
    if trust is not None:
        data["ca.crt"] = trust
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": owned_meta(cluster, name, broker), "data": b64(data),
    }  # fmt: skip


def _certificate(
    cluster: ClusterRef,
    tls: Tls,
    secret_name: str,
    names: list[str],
    usages: list[str],
    *,
    common_name: str | None = None,
    name: str | None = None,
    broker: BrokerName | None = None,
) -> Obj:
    """A cert-manager `Certificate` the BrokerCluster owns (with `spec.tls.issuerRef`); its
    Secret is owned too (`secretTemplate`: it goes with the Certificate)."""
    assert tls.issuer_ref is not None
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": owned_meta(cluster, name or secret_name, broker),
        "spec": {
            "secretName": secret_name,
            "commonName": common_name or names[0],
            "dnsNames": names,
            "usages": [*usages, "digital signature", "key encipherment"],
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": tls.issuer_ref.model_dump(by_alias=True),
            "secretTemplate": {"labels": owned_meta(cluster, "", broker)["labels"]},
        },
    }  # fmt: skip


def build_ca_secret(cluster: ClusterRef, memory: TlsMemory) -> Obj:
    """The operator-managed CA's Secret: the signing CA, and a rotation's state."""
    assert memory.ca is not None
    extra = carotation.secret_data(memory)
    return _tls_secret(cluster, ca_secret_name(cluster), memory.ca, None, extra=extra)


def build_server_secret(cluster: ClusterRef, tls: Tls, server: KeyPair, trust: str) -> Obj:
    """The brokers' server certificate Secret (what cert-manager would write, `ca.crt`
    included)."""
    return _tls_secret(cluster, tls_secret_name(cluster, tls), server, trust)


def build_ca_config_map(cluster: ClusterRef, ca_cert: str) -> Obj:
    """`<cluster>-ca`: the CA certificate clients verify the brokers against."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": owned_meta(cluster, ca_config_map_name(cluster)),
        "data": {"ca.crt": ca_cert},
    }  # fmt: skip


def build_peer_secret(cluster: ClusterRef, broker: BrokerName, cert: KeyPair, trust: str) -> Obj:
    """A broker's own certificate Secret (`<cluster>-<broker>-tls`, with `ca.crt`)."""
    return _tls_secret(cluster, peer_secret_name(cluster, broker), cert, trust, broker)


def build_mirror_secret(cluster: ClusterRef, cert: KeyPair, trust: str) -> Obj:
    """The site's mirror certificate Secret (`<cluster>-mirror-tls`, with `ca.crt`: the CA
    the other site copies in)."""
    return _tls_secret(cluster, mirroring.secret_name(cluster.name), cert, trust)


def build_mirror_certificate(cluster: ClusterRef, spec: BrokerClusterSpec) -> Obj:
    """The cert-manager `Certificate` of the site's mirror identity (with `issuerRef`)."""
    return _certificate(
        cluster, spec.tls, mirroring.secret_name(cluster.name),
        mirroring.certificate_names(spec, cluster.namespace, vip_name(cluster)),
        ["server auth", "client auth"],
        common_name=mirroring.site_id(cluster.namespace, cluster.name),
    )  # fmt: skip


def build_peer_certificate(cluster: ClusterRef, tls: Tls, broker: BrokerName) -> Obj:
    """The cert-manager `Certificate` of one broker's own names, for server and client use
    (with `spec.tls.issuerRef`)."""
    return _certificate(
        cluster, tls, peer_secret_name(cluster, broker), peer_names(cluster, broker),
        ["server auth", "client auth"], broker=broker,
    )  # fmt: skip


def build_certificate(cluster: ClusterRef, tls: Tls) -> Obj:
    """The cert-manager `Certificate` of the brokers' names (with `spec.tls.issuerRef`)."""
    return _certificate(
        cluster, tls, tls_secret_name(cluster, tls), dns_names(cluster), ["server auth"],
        name=f"{cluster.name}-tls",
    )  # fmt: skip


# -- reconcile ------------------------------------------------------------------------------


class SecretReader(Protocol):
    """What reconciling certificates reads from the API server (`operator.kube.Kube`)."""

    def get_secret_data(
        self, namespace: str, name: str, owner: Owner | None = None
    ) -> dict[str, str] | None:
        """A Secret's data (None: absent); with `owner`, one under a generated name:
        raises `kube.Foreign` unless `owner` owns it."""
        ...


def mine(cluster: ClusterRef, certificate: str | None = None) -> Owner:
    """The owner every Secret the operator generates for `cluster` must have (with
    cert-manager, `certificate`: the Certificate whose Secret it reads)."""
    return Owner(cluster.uid, certificate)


@dataclass
class Issued:
    """A certificate the operator issued and keeps (read from its Secret once a process)."""

    pair: KeyPair | None = None
    renew_at: datetime | None = None
    names: list[str] = field(default_factory=list)


@dataclass
class TlsMemory:
    """What the operator keeps between passes: the managed CA and server certificate (read
    from their Secrets once per process), or when it last read a Secret it does not issue."""

    ca: KeyPair | None = None  # the managed CA that signs
    ca_next: KeyPair | None = None  # a rotation's new CA, trusted, not signing yet
    ca_previous: str | None = None  # a rotation's old CA, still trusted
    rotation: CaRotation | None = None  # where the last rotation stands (operator/carotation.py)
    ca_renew_at: datetime | None = None  # when the signing CA is due to be rotated by age
    events: list[str] = field(default_factory=list)  # rotation steps, for Events (drained)
    load_errors: dict[str, float | None] = field(default_factory=dict)  # pod/listener: reported
    server: KeyPair | None = None
    renew_at: datetime | None = None
    names: list[str] = field(default_factory=list)
    ca_cert: str | None = None  # of a Secret the operator does not issue
    read_at: float = float("-inf")
    peers: dict[BrokerName, Issued] = field(default_factory=dict)  # each broker's own
    mirror: Issued | None = None  # the site's mirror identity (read once, then kept)
    federation: Issued | None = None  # the federation links' client certificate (likewise)
    issued: int = 0  # certificates issued by this process (tests, logs)
    trusted: str | None = None  # the CA the brokers' own certificates chain to (admin HTTPS)
    no_cert_manager: bool = False  # issuerRef given, cert-manager's API absent (logged once)


def _pair(data: Mapping[str, str] | None) -> KeyPair | None:
    if not data or not data.get("tls.crt") or not data.get("tls.key"):
        return None
    return KeyPair(data["tls.crt"], data["tls.key"])


def reconcile_managed(
    cluster: ClusterRef,
    tls: Tls,
    memory: TlsMemory,
    secrets: SecretReader,
    now: datetime,
    seconds: int,
    rotate: str | None = None,
    grace: int = carotation.DEFAULT_CA_GRACE,
    loaded: carotation.Loaded | None = None,
) -> tuple[KeyPair, KeyPair]:
    """The managed CA and server certificate as they must be now: read from their Secrets
    on the first pass, made when missing, the CA rotated when `rotate` (a request id) or
    its age asks (`operator/carotation.py`), the server certificate issued again when
    `reissue_reason` says so. Cheap when nothing is due (no parsing, no reads)."""
    names = dns_names(cluster)
    if memory.ca is None:
        data = secrets.get_secret_data(cluster.namespace, ca_secret_name(cluster), mine(cluster))
        memory.ca = _pair(data)
        if memory.ca is None:
            memory.ca = new_ca(cluster, now)
            log.info("%s/%s: made the cluster's CA", cluster.namespace, cluster.name)
        else:
            carotation.read(memory, data or {}, KeyPair)
        found = secrets.get_secret_data(
            cluster.namespace, tls_secret_name(cluster, tls), mine(cluster)
        )
        memory.server, memory.renew_at = _pair(found), None
    signer = memory.ca
    if memory.ca_renew_at is None:
        memory.ca_renew_at = renew_at(signer.certificate())
    aged = now >= memory.ca_renew_at
    step = carotation.advance(memory, rotate, aged, now, grace, lambda: new_ca(cluster, now),
                              loaded)  # fmt: skip
    if step is not None:
        log.info("%s/%s: %s", cluster.namespace, cluster.name, step)
        memory.events.append(step)
    if memory.ca is not signer:  # a new CA signs: every certificate is issued again now
        memory.renew_at = memory.ca_renew_at = None
        for kept in (*memory.peers.values(), memory.mirror, memory.federation):
            if kept is not None:
                kept.renew_at = None
    due = memory.renew_at is None or now >= memory.renew_at or memory.names != names
    if due:
        reason = reissue_reason(memory.server, memory.ca, names, now)
        if reason is not None:
            memory.server = issue_server(memory.ca, names, now, seconds)
            memory.issued += 1
            log.info("%s/%s: issued the brokers' server certificate: %s",
                     cluster.namespace, cluster.name, reason)  # fmt: skip
        assert memory.server is not None
        memory.renew_at, memory.names = renew_at(memory.server.certificate()), names
    assert memory.server is not None
    return memory.ca, memory.server


def reconcile_peer(
    cluster: ClusterRef,
    broker: BrokerName,
    ca: KeyPair,
    memory: TlsMemory,
    secrets: SecretReader,
    now: datetime,
    seconds: int,
) -> KeyPair:
    """A broker's own certificate as it must be now (like `reconcile_managed`'s server
    certificate: read once, issued when missing, due, renamed or of another CA)."""
    names = peer_names(cluster, broker)
    kept = memory.peers.get(broker)
    if kept is None:
        name = peer_secret_name(cluster, broker)
        found = secrets.get_secret_data(cluster.namespace, name, mine(cluster))
        kept = memory.peers[broker] = Issued(_pair(found))
    what = f"{cluster.namespace}/{cluster.name}: {broker}'s own certificate"
    return _kept_current(kept, ca, names, now, seconds, memory, what)


def _kept_current(
    kept: Issued,
    ca: KeyPair,
    names: list[str],
    now: datetime,
    seconds: int,
    memory: TlsMemory,
    what: str,
    site: str | None = None,
) -> KeyPair:
    """`kept` (a client + server certificate) as it must be now: issued again when
    missing, due, renamed, of another CA, or (`site`) naming another common name."""
    if kept.renew_at is None or now >= kept.renew_at or kept.names != names:
        reason = reissue_reason(kept.pair, ca, names, now)
        named = None if kept.pair is None else common_name(kept.pair.certificate())
        if reason is None and site is not None and named != site:
            reason = f"it names another site than {site}"
        if reason is not None:
            kept.pair = issue_server(ca, names, now, seconds, client=True, common_name=site)
            memory.issued += 1
            log.info("%s issued: %s", what, reason)
        assert kept.pair is not None
        kept.renew_at, kept.names = renew_at(kept.pair.certificate()), names
    assert kept.pair is not None
    return kept.pair


def common_name(cert: x509.Certificate) -> str | None:
    """A certificate's common name."""
    found = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = found[0].value if found else None
    return value if isinstance(value, str) else None


def reconcile_mirror(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    ca: KeyPair,
    memory: TlsMemory,
    secrets: SecretReader,
    now: datetime,
    seconds: int,
) -> KeyPair:
    """The site's mirror certificate as it must be now (read once, issued when missing,
    due, renamed or of another CA, like a broker's own)."""
    names = mirroring.certificate_names(spec, cluster.namespace, vip_name(cluster))
    site = mirroring.site_id(cluster.namespace, cluster.name)
    kept = memory.mirror
    if kept is None:
        name = mirroring.secret_name(cluster.name)
        found = secrets.get_secret_data(cluster.namespace, name, mine(cluster))
        kept = memory.mirror = Issued(_pair(found))
    what = f"{cluster.namespace}/{cluster.name}: the site's mirror certificate"
    return _kept_current(kept, ca, names, now, seconds, memory, what, site)


def reconcile_federation_client(
    cluster: ClusterRef,
    ca: KeyPair,
    memory: TlsMemory,
    secrets: SecretReader,
    now: datetime,
    seconds: int,
) -> KeyPair:
    """The federation links' client certificate as it must be now (read once, issued when
    missing, due or of another CA, like a broker's own)."""
    names = federationtls.client_names(cluster.namespace, cluster.name)
    site = mirroring.site_id(cluster.namespace, cluster.name)
    kept = memory.federation
    if kept is None:
        name = federationtls.client_secret_name(cluster.name)
        found = secrets.get_secret_data(cluster.namespace, name, mine(cluster))
        kept = memory.federation = Issued(_pair(found))
    what = f"{cluster.namespace}/{cluster.name}: the federation client certificate"
    return _kept_current(kept, ca, names, now, seconds, memory, what, site)


def build_federation_client_secret(cluster: ClusterRef, cert: KeyPair, trust: str) -> Obj:
    """`<cluster>-federation-tls`: what the federation links present to their upstreams."""
    return _tls_secret(cluster, federationtls.client_secret_name(cluster.name), cert, trust)


def build_federation_client_certificate(cluster: ClusterRef, spec: BrokerClusterSpec) -> Obj:
    """The cert-manager `Certificate` of the federation links' client certificate."""
    return _certificate(
        cluster, spec.tls, federationtls.client_secret_name(cluster.name),
        federationtls.client_names(cluster.namespace, cluster.name), ["client auth"],
        common_name=mirroring.site_id(cluster.namespace, cluster.name),
    )  # fmt: skip


def reconcile_tls(
    cluster: ClusterRef,
    spec: BrokerClusterSpec,
    memory: TlsMemory,
    secrets: SecretReader,
    apply: Callable[[Obj], None],
    *,
    now: datetime | None = None,
    clock: float = 0.0,
    seconds: int | None = None,
    grace: int | None = None,
    loaded: carotation.Loaded | None = None,
) -> None:
    """Keep the brokers' certificate objects: the managed CA (rotated on request or with
    age: `operator/carotation.py`) and server Secrets, or the cert-manager Certificate;
    and the `<cluster>-ca` ConfigMap (the trust bundle). `clock` is a monotonic time (how
    often a Secret the operator does not issue is read); `grace` a rotation's phase length
    (default: the operator setting); `loaded` what each broker pod reports it loaded of
    its TLS files (a rotation's phase waits for all to have loaded its files). Disabling
    TLS leaves the objects (owned: they go with the cluster)."""
    tls = spec.tls
    if not tls.enabled:
        return
    if tls.issuer_ref is None and tls.secret_name is None:
        now, seconds = now or datetime.now(UTC), cert_seconds() if seconds is None else seconds
        rotate = spec.requests.rotate_ca.id if spec.requests.rotate_ca is not None else None
        ca, server = reconcile_managed(
            cluster, tls, memory, secrets, now, seconds, rotate,
            carotation.grace_seconds() if grace is None else grace, loaded,
        )  # fmt: skip
        trust = carotation.bundle(memory)
        apply(build_ca_secret(cluster, memory))
        apply(build_server_secret(cluster, tls, server, trust))
        for broker in BROKERS:
            own = reconcile_peer(cluster, broker, ca, memory, secrets, now, seconds)
            apply(build_peer_secret(cluster, broker, own, trust))
        if mirroring.certificate_wanted(spec):
            site = reconcile_mirror(cluster, spec, ca, memory, secrets, now, seconds)
            apply(build_mirror_secret(cluster, site, trust))
        if federationtls.client_certificate_wanted(spec, cluster.name):
            client = reconcile_federation_client(cluster, ca, memory, secrets, now, seconds)
            apply(build_federation_client_secret(cluster, client, trust))
        apply(build_ca_config_map(cluster, trust))
        return
    if tls.issuer_ref is not None:
        apply(build_certificate(cluster, tls))
        for broker in BROKERS:
            apply(build_peer_certificate(cluster, tls, broker))
        if mirroring.certificate_wanted(spec):
            apply(build_mirror_certificate(cluster, spec))
        if federationtls.client_certificate_wanted(spec, cluster.name):
            apply(build_federation_client_certificate(cluster, spec))
    if clock - memory.read_at >= READ_EVERY:
        memory.read_at = clock
        # cert-manager's Secret only if it is our Certificate's; your own Secret is yours.
        owner = mine(cluster, f"{cluster.name}-tls") if tls.issuer_ref is not None else None
        found = secrets.get_secret_data(cluster.namespace, tls_secret_name(cluster, tls), owner)
        memory.ca_cert = (found or {}).get("ca.crt") or None
    if memory.ca_cert is not None:
        apply(build_ca_config_map(cluster, memory.ca_cert))


def brokers_ca(
    cluster: ClusterRef, tls: Tls, memory: TlsMemory, secrets: SecretReader
) -> str | None:
    """The CA the operator verifies the brokers' admin HTTPS against: its own CA (from
    memory, or read from its Secret once: a restarted operator probes before it reconciles
    the certificates), or the `ca.crt` cert-manager wrote beside a broker's certificate."""
    if memory.ca is not None:
        return carotation.bundle(memory)  # a pod not yet given a rotated certificate too
    if memory.trusted is None:
        managed = tls.issuer_ref is None and tls.secret_name is None
        name = ca_secret_name(cluster) if managed else peer_secret_name(cluster, BROKERS[0])
        # With cert-manager, the peer Certificate is named as its Secret.
        owner = mine(cluster, None if managed else name)
        found = secrets.get_secret_data(cluster.namespace, name, owner) or {}
        memory.trusted = found.get("tls.crt" if managed else "ca.crt") or None
    return memory.trusted
