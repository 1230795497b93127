"""The broker's TLS (AMQPS, the admin API's HTTPS, the replication link), reloaded with its files.

With `--tls-cert` and `--tls-key` the broker also listens for AMQP over TLS on
`--tls-port` (5671, RabbitMQ's and the IANA's AMQPS port), beside the plain
port; with `--admin-tls-cert` and `--admin-tls-key` the admin API answers HTTPS
only. With `--tls-ca` it asks for a client certificate: with `--tls-client-certs
required` (the default with a CA) it refuses a client without one signed by that CA
(mutual TLS, RabbitMQ's `verify_peer` with `fail_if_no_peer_cert` true); with
`optional` a client may present none, and one it presents is verified all the same
(`fail_if_no_peer_cert` false: ordinary clients log in with a password, a federation
link presents its site's certificate). With `--replication-tls-cert`, `-key` and `-ca` the
replication link is mutual TLS (`MutualTls`): each broker presents its certificate,
verifies the other's against the CA and checks that it names the broker the
handshake claims. With `--mirror-tls-cert`, `-key` and `-ca` the DR mirror link is
mutual TLS the same way (`broker/mirror/`: one certificate per site, the other site's CA).
TLS 1.2 is the oldest version spoken.

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
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID

from twinmq.broker.api import TlsCertificateStatus, TlsFilesStatus, TlsListenerName
from twinmq.broker.filewatch import FileWatch

log = logging.getLogger(__name__)


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
        usages = x509.load_der_x509_certificate(der).extensions.get_extension_for_class(
            x509.ExtendedKeyUsage
        )
    except (ValueError, x509.ExtensionNotFound):
        return False
    wanted = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    return wanted <= set(usages.value)


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
    same bundle text, so what is reported is what verifies)."""

    def __init__(self, cert: Path, ca: Path | None) -> None:
        self.leaf_pem = cert.read_bytes()
        self.ca_pem = ca.read_text() if ca is not None else None
        self.certificate = describe(x509.load_pem_x509_certificate(self.leaf_pem))
        self.cas = [] if self.ca_pem is None else [
            fingerprint(c) for c in x509.load_pem_x509_certificates(self.ca_pem.encode())
        ]  # fmt: skip
        self.at = time.time()


class TlsListener:
    """The server-side TLS context of a listener, kept current with its files."""

    def __init__(
        self, cert: Path, key: Path, ca: Path | None = None, *, optional: bool = False
    ) -> None:
        """`ca`: verify client certificates against it, required unless `optional`
        (OpenSSL's SSL_VERIFY_PEER without FAIL_IF_NO_PEER_CERT: a certificate presented
        that does not verify still fails the handshake)."""
        self.cert, self.key, self.ca, self.optional = cert, key, ca, optional
        self.reloads = self.load_errors = 0
        self.load_error: str | None = None
        self.load_error_at: float | None = None
        self._watch = FileWatch(cert, key, ca)
        # Raises at start-up: a broker does not start with files it cannot use.
        self._loaded = _Loaded(cert, ca)
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
        return context

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
            self._loaded = _Loaded(self.cert, self.ca)
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
