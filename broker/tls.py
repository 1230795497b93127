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
certificate stays in use.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

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


class TlsListener:
    """The server-side TLS context of a listener, kept current with its files."""

    def __init__(
        self, cert: Path, key: Path, ca: Path | None = None, *, optional: bool = False
    ) -> None:
        """`ca`: verify client certificates against it, required unless `optional`
        (OpenSSL's SSL_VERIFY_PEER without FAIL_IF_NO_PEER_CERT: a certificate presented
        that does not verify still fails the handshake)."""
        self.cert, self.key, self.ca, self.optional = cert, key, ca, optional
        self.reloads = 0
        self._watch = FileWatch(cert, key, ca)
        # Raises at start-up: a broker does not start with files it cannot use.
        self.context = self._server_context()  # the one the listening socket holds
        self._current = self.context
        # Each handshake is moved to the newest context (its server-name callback runs at
        # every ClientHello, SNI or not): a reload that drops a CA from the bundle drops it
        # from verification too, which adding files to the listening context never could
        # (OpenSSL's certificate store only grows).
        self.context.sni_callback = self._newest
        self._load_more()

    def _server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            context.verify_mode = ssl.CERT_OPTIONAL if self.optional else ssl.CERT_REQUIRED
        context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            context.load_verify_locations(self.ca)
        return context

    def _newest(self, conn: ssl.SSLObject, _name: str | None, held: ssl.SSLContext) -> None:
        if self._current is not held:
            conn.context = self._current

    def _load_more(self) -> None:
        """What a subclass builds from the same files (after the server context)."""

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since the last look; whether it did."""
        if not self._watch.changed():
            return False
        try:
            fresh = self._server_context()
            self._load_more()
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS files %s, %s changed but do not load (%s): keeping the old ones",
                      self.cert, self.key, exc)  # fmt: skip
            return False
        self._current = fresh
        self.reloads += 1
        log.info("TLS certificate reloaded from %s (new connections use it)", self.cert)
        return True


class MutualTls(TlsListener):
    """Both ends of a mutual-TLS link (replication): `context` accepts peers, `client`
    connects to them, over the same files, reloaded together. Each end verifies that the
    other's certificate was signed by the CA; the client also checks the host name it
    dialled (`check_hostname`), and both check the broker name the peer claims in the
    handshake (`identity_refusal`)."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        super().__init__(cert, key, ca)

    def _load_more(self) -> None:
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks host names
        client.minimum_version = ssl.TLSVersion.TLSv1_2
        client.load_cert_chain(self.cert, self.key)
        assert self.ca is not None
        client.load_verify_locations(self.ca)
        self.client = client  # read at each dial


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
