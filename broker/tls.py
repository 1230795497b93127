"""The broker's TLS (AMQPS, the admin API's HTTPS, the replication link), reloaded with its files.

With `--tls-cert` and `--tls-key` the broker also listens for AMQP over TLS on
`--tls-port` (5671, RabbitMQ's and the IANA's AMQPS port), beside the plain
port; with `--admin-tls-cert` and `--admin-tls-key` the admin API answers HTTPS
only. With `--tls-ca` it asks for a client certificate: with `--tls-client-certs
required` (the default with a CA) it refuses a client without one signed by that CA
(mutual TLS, RabbitMQ's `verify_peer` with `fail_if_no_peer_cert` true); with
`optional` a client may present none, and one it presents is verified all the same
(`fail_if_no_peer_cert` false: ordinary clients log in with a password, a federation
link presents its site's certificate). With `--tls-cert-login` a verified client
certificate may also be the login (SASL EXTERNAL: `verified_peer_certificate`,
`certificate_login_name`, broker/auth.py). With `--tls-federation-ca` the handshake
also verifies client certificates against federation downstreams' CAs, which never log
anyone in: a certificate login then needs a certificate a CA of `--tls-ca` signed
(`TlsListener.login_refusal`; docs/security.md, "Whose CA may log in"). With
`--replication-tls-cert`, `-key` and `-ca` the replication link is mutual TLS
(`MutualTls`): each broker presents its certificate, verifies the other's against the CA
and checks that it names the broker the handshake claims. With `--mirror-tls-cert`,
`-key` and `-ca` the DR mirror link is mutual TLS the same way (`broker/mirror/`: one
certificate per site, the other site's CA). TLS 1.2 is the oldest version spoken.

Rotation: cert-manager and the kubelet replace the files in place; every few
seconds the broker compares their modification times and sizes and, if they
changed, builds new `SSLContext`s from them; each new handshake is moved to the
newest one (the listening context's server-name callback), so new handshakes use
the new certificate and the new CA bundle, a CA removed from it included;
established connections keep theirs and are not dropped. A pair of files that
does not load (half-written, or a key that does not match) is logged and the old
certificate stays in use. `TlsListener.status` says what is loaded now (the certificate's
fingerprint, serial, issuer and signing key, the bundle's CAs' fingerprints, when) and
why the last reload failed if it did: `GET /status` carries it, and the operator's CA
rotation (operator/carotation.py) waits for every pod to have loaded each phase's files.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from twinmq.broker.api import TlsCertificateStatus, TlsFilesStatus, TlsListenerName
from twinmq.broker.filewatch import FileWatch

log = logging.getLogger(__name__)

CertLogin = Literal["off", "common_name", "distinguished_name", "san_dns", "san_email"]
"""Where a certificate login (EXTERNAL) takes the user name from (`--tls-cert-login`):
RabbitMQ's `ssl_cert_login_from` (`common_name`, `distinguished_name`), and its
`subject_alternative_name` with `ssl_cert_login_san_type` `dns` or `email` and
`ssl_cert_login_san_index` 0 (`san_dns`, `san_email`); `off`: EXTERNAL not offered."""

CERT_LOGIN_SOURCES: dict[CertLogin, str] = {
    "off": "name (certificate login is off)",
    "common_name": "common name",
    "distinguished_name": "subject",
    "san_dns": "DNS subject alternative name",
    "san_email": "e-mail subject alternative name",
}
"""What each `CertLogin` takes the name from, as refusals say it."""


def certificate_names(writer: asyncio.StreamWriter) -> set[str] | None:
    """The DNS names (and the common name) of the peer's verified certificate; None
    without TLS."""
    if writer.get_extra_info("sslcontext") is None:
        return None
    cert: Any = writer.get_extra_info("peercert") or {}
    names = {value for kind, value in cert.get("subjectAltName", ()) if kind == "DNS"}
    for rdn in cert.get("subject", ()):
        names.update(value for key, value in rdn if key == "commonName")
    return names


def both_ends(writer: asyncio.StreamWriter) -> bool:
    """Whether the peer's certificate is for both ends of a link (client and server use,
    as each broker's own is): a server-only certificate that happens to name a broker
    (the AMQPS one names both pods) is no replication identity."""
    ssl_object: Any = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        return False
    try:
        return broker_certificate(x509.load_der_x509_certificate(der))
    except ValueError:
        return False


def broker_certificate(cert: x509.Certificate) -> bool:
    """Whether `cert` is for client and server use (its extended key usage says both), as
    a broker's own is (`both_ends`): a replication identity, never an application's login."""
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except (ValueError, x509.ExtensionNotFound):
        return False
    wanted = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    return wanted <= set(usages.value)


def verified_peer_certificate(transport: asyncio.BaseTransport) -> x509.Certificate | None:
    """The client certificate of a TLS connection, if the listener verified one (it asks
    for one with `--tls-ca`; OpenSSL fails the handshake of one that does not verify):
    None on plaintext, without a CA, or when the client presented none."""
    ssl_object: Any = transport.get_extra_info("ssl_object")
    if ssl_object is None or ssl_object.context.verify_mode == ssl.CERT_NONE:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return x509.load_der_x509_certificate(der)


def _issued_by(certificate: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether `ca` signed `certificate` (its subject is the issuer and its key the
    signature's): a CA of the same name but another key did not."""
    try:
        certificate.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def certificate_login_name(cert: x509.Certificate, source: CertLogin) -> str | None:
    """The user name a certificate login takes from `cert` (None if it carries no such
    name): the first common name; the subject as RFC 4514 writes it (OpenSSL's `-nameopt
    RFC2253`, most specific first: `CN=billing,O=Example`, what RabbitMQ's
    `distinguished_name` gives); the first DNS or e-mail subject alternative name."""
    if source == "common_name":
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        value = names[0].value if names else None
        return value if isinstance(value, str) and value else None
    if source == "distinguished_name":
        return cert.subject.rfc4514_string() or None
    if source in ("san_dns", "san_email"):
        kind = x509.DNSName if source == "san_dns" else x509.RFC822Name
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except (ValueError, x509.ExtensionNotFound):
            return None
        found = san.get_values_for_type(kind)
        return found[0] if found else None
    return None


def identity_refusal(writer: asyncio.StreamWriter, name: str) -> str | None:
    """Why a mutual-TLS peer that says it is `name` is refused (its certificate does not
    name it, or is not for client and server use), or None (it is, or the link is not
    TLS)."""
    names = certificate_names(writer)
    if names is None:
        return None
    if name not in names:
        return f"its certificate names {sorted(names)}, not {name!r}"
    if not both_ends(writer):
        return "its certificate is not for client and server use (not a broker's own)"
    return None


def fingerprint(cert: x509.Certificate) -> str:
    """A certificate's SHA-256 fingerprint (of its DER), lowercase hex."""
    return cert.fingerprint(hashes.SHA256()).hex()


def key_id(cert: x509.Certificate) -> str:
    """The key identifier of a CA certificate (its Subject Key Identifier, else the one
    derived from its public key as RFC 5280 does), lowercase hex: what the certificates
    it signs carry as their Authority Key Identifier."""
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest.hex()
    except x509.ExtensionNotFound:
        return x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest.hex()


def describe(cert: x509.Certificate) -> TlsCertificateStatus:
    """What `/status` says of a certificate."""
    try:
        aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
        authority = aki.key_identifier.hex() if aki.key_identifier is not None else None
    except x509.ExtensionNotFound:
        authority = None
    return TlsCertificateStatus(
        fingerprint=fingerprint(cert),
        serial=format(cert.serial_number, "x"),
        issuer=cert.issuer.rfc4514_string(),
        authority_key_id=authority,
        not_after=cert.not_valid_after_utc.timestamp(),
    )


class _Loaded:
    """What one load read: the files' content, described (the contexts are built from the
    same bundle text, so what is reported is what verifies). `login_cas`: the CAs of `ca`
    (a certificate one of them signed may log in), not those of `federation_ca`."""

    def __init__(self, cert: Path, ca: Path | None, federation_ca: Path | None = None) -> None:
        self.leaf_pem = cert.read_bytes()
        self.ca_pem = ca.read_text() if ca is not None else None
        self.federation_pem = federation_ca.read_text() if federation_ca is not None else None
        self.certificate = describe(x509.load_pem_x509_certificate(self.leaf_pem))
        self.login_cas = [] if self.ca_pem is None else x509.load_pem_x509_certificates(
            self.ca_pem.encode())  # fmt: skip
        federation = [] if self.federation_pem is None else x509.load_pem_x509_certificates(
            self.federation_pem.encode())  # fmt: skip
        self.cas = [fingerprint(c) for c in (*self.login_cas, *federation)]
        self.at = time.time()


class TlsListener:
    """The server-side TLS context of a listener, kept current with its files."""

    def __init__(
        self,
        cert: Path,
        key: Path,
        ca: Path | None = None,
        *,
        optional: bool = False,
        federation_ca: Path | None = None,
    ) -> None:
        """`ca`: verify client certificates against it, required unless `optional`
        (OpenSSL's SSL_VERIFY_PEER without FAIL_IF_NO_PEER_CERT: a certificate presented
        that does not verify still fails the handshake). `federation_ca`: more CAs the
        handshake verifies against, whose certificates never log in (`login_refusal`)."""
        self.cert, self.key, self.ca, self.optional = cert, key, ca, optional
        self.federation_ca = federation_ca
        self.reloads = self.load_errors = 0
        self.load_error: str | None = None
        self.load_error_at: float | None = None
        self._watch = FileWatch(cert, key, ca, federation_ca)
        # Raises at start-up: a broker does not start with files it cannot use.
        self._loaded = _Loaded(cert, ca, federation_ca)
        self.context = self._server_context()  # the one the listening socket holds
        self._current = self.context
        # Each handshake is moved to the newest context (its server-name callback runs at
        # every ClientHello, SNI or not): a reload that drops a CA from the bundle drops it
        # from verification too, which adding files to the listening context never could
        # (OpenSSL's certificate store only grows).
        self.context.sni_callback = self._newest
        self._install(self._build_more())

    def _server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            context.verify_mode = ssl.CERT_OPTIONAL if self.optional else ssl.CERT_REQUIRED
        context.load_cert_chain(self.cert, self.key)
        if self._loaded.ca_pem is not None:
            context.load_verify_locations(cadata=self._loaded.ca_pem)
        if self._loaded.federation_pem is not None:
            context.load_verify_locations(cadata=self._loaded.federation_pem)
        return context

    def login_refusal(self, certificate: x509.Certificate) -> str | None:
        """Why a verified client `certificate` may not log in (EXTERNAL), or None. Without
        `federation_ca` every CA the handshake trusts is a login CA (`--tls-ca`, as
        before). With it, the handshake also trusts the downstreams' CAs, whose keys other
        tenants hold: only a certificate a CA of `ca` signed directly logs in (Python 3.11
        gives no verified chain, so the issuer is checked by its signature; an
        intermediate CA goes in `ca` itself)."""
        if self.federation_ca is None:
            return None
        loaded = self._loaded
        if any(_issued_by(certificate, ca) for ca in loaded.login_cas):
            return None
        return (
            f"certificate login refused: its issuer '{certificate.issuer.rfc4514_string()}' "
            "is not a login CA (--tls-ca): a federation downstream's CA "
            "(--tls-federation-ca) is trusted for the TLS handshake only"
        )

    def _newest(self, conn: ssl.SSLObject, _name: str | None, held: ssl.SSLContext) -> None:
        if self._current is not held:
            conn.context = self._current

    def _build_more(self) -> ssl.SSLContext | None:
        """What a subclass builds from the same files (after the server context)."""
        return None

    def _install(self, more: ssl.SSLContext | None) -> None:
        """Put what `_build_more` built in use (only once the whole load succeeded)."""

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since the last look; whether it did."""
        if not self._watch.changed():
            return False
        kept = self._loaded
        try:
            self._loaded = _Loaded(self.cert, self.ca, self.federation_ca)
            fresh, more = self._server_context(), self._build_more()
            if self.cert.read_bytes() != self._loaded.leaf_pem:
                # Replaced while being read: what was described may not be what loaded.
                self._watch.forget()  # so the next look loads it again
                raise OSError(f"{self.cert} changed while it was being loaded")
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._loaded = kept  # and the contexts in use are untouched
            self.load_errors += 1
            self.load_error, self.load_error_at = f"{type(exc).__name__}: {exc}", time.time()
            log.error("TLS files %s, %s changed but do not load (%s): keeping the old ones",
                      self.cert, self.key, exc)  # fmt: skip
            return False
        self._current = fresh
        self._install(more)
        self.reloads += 1
        self.load_error = self.load_error_at = None
        log.info("TLS certificate reloaded from %s (new connections use it)", self.cert)
        return True

    def status(self, listener: TlsListenerName) -> TlsFilesStatus:
        """The files as loaded now, for `GET /status` (`listener`: which one this is)."""
        loaded = self._loaded
        return TlsFilesStatus(
            listener=listener,
            cert_file=str(self.cert),
            certificate=loaded.certificate,
            ca_file=None if self.ca is None else str(self.ca),
            ca_fingerprints=loaded.cas,
            loaded_at=loaded.at,
            reloads=self.reloads,
            load_errors=self.load_errors,
            load_error=self.load_error,
            load_error_at=self.load_error_at,
        )


class MutualTls(TlsListener):
    """Both ends of a mutual-TLS link (replication): `context` accepts peers, `client`
    connects to them, over the same files, reloaded together. Each end verifies that the
    other's certificate was signed by the CA; the client also checks the host name it
    dialled (`check_hostname`), and both check the broker name the peer claims in the
    handshake (`identity_refusal`)."""

    client: ssl.SSLContext  # read at each dial

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        super().__init__(cert, key, ca)

    def _build_more(self) -> ssl.SSLContext:
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks host names
        client.minimum_version = ssl.TLSVersion.TLSv1_2
        client.load_cert_chain(self.cert, self.key)
        assert self._loaded.ca_pem is not None
        client.load_verify_locations(cadata=self._loaded.ca_pem)
        return client

    def _install(self, more: ssl.SSLContext | None) -> None:
        assert more is not None
        self.client = more


def report_refused_handshakes(
    context: ssl.SSLContext, refused: Callable[[ssl.SSLError], None]
) -> None:
    """Have a listener's `context` call `refused` for each handshake a peer fails (a
    certificate of a CA not trusted, none at all, a protocol error). asyncio and uvloop
    drop a failed server-side handshake silently (a debug line), and a link's own
    `start_tls` on an accepted connection is no way round it: under uvloop it stalls
    until its deadline when the peer's ClientHello came in first. So the listener does
    the handshake and its SSL objects report here."""

    class Reported(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, ssl.SSLEOFError):
                raise  # more bytes needed, or the peer hung up: no refusal
            except ssl.SSLError as exc:
                refused(exc)
                raise

    context.sslobject_class = Reported
