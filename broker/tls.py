"""The broker's TLS listeners (AMQPS, the admin API's HTTPS), reloaded when their files change.

With `--tls-cert` and `--tls-key` the broker also listens for AMQP over TLS on
`--tls-port` (5671, RabbitMQ's and the IANA's AMQPS port), beside the plain
port; with `--admin-tls-cert` and `--admin-tls-key` the admin API answers HTTPS
only. With `--tls-ca` it asks for a client certificate and refuses a client
without one signed by that CA (mutual TLS, RabbitMQ's `verify_peer` with
`fail_if_no_peer_cert`). TLS 1.2 is the oldest version spoken.

Rotation: cert-manager and the kubelet replace the files in place; every few
seconds the broker compares their modification times and sizes and, if they
changed, loads them into the same `SSLContext`. New handshakes use the new
certificate; established connections keep theirs and are not dropped. A pair of
files that does not load (half-written, or a key that does not match) is
logged and the old certificate stays in use.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from twinmq.broker.filewatch import FileWatch

log = logging.getLogger(__name__)


class TlsListener:
    """The server-side TLS context of a listener, kept current with its files."""

    def __init__(self, cert: Path, key: Path, ca: Path | None = None) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        if ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
        self.reloads = 0
        self._watch = FileWatch(cert, key, ca)
        self._load()  # raises at start-up: a broker does not start with files it cannot use

    def _load(self) -> None:
        self.context.load_cert_chain(self.cert, self.key)
        if self.ca is not None:
            self.context.load_verify_locations(self.ca)

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed since the last look; whether it did."""
        if not self._watch.changed():
            return False
        try:
            self._load()
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS files %s, %s changed but do not load (%s): keeping the old ones",
                      self.cert, self.key, exc)  # fmt: skip
            return False
        self.reloads += 1
        log.info("TLS certificate reloaded from %s (new connections use it)", self.cert)
        return True
