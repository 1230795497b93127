"""TLS listeners: AMQPS with real clients, client certificates, a certificate rotated under
traffic; the admin API over HTTPS."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pika
import pytest

from twinmq.broker.admin_client import SyncAdminClient
from twinmq.broker.names import ACTIVE
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

# How a refused TLS client fails in pika: the handshake's own error (its side refused), or
# the connection lost before connection.start (the broker's side refused, TLS 1.3).
REFUSED = (pika.exceptions.AMQPError, ssl.SSLError, ConnectionError)


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "pki")


@dataclass
class TlsBroker:
    """A broker process with AMQPS on `port`; its certificate files in `live` (replaceable)."""

    process: BrokerProcess
    port: int
    live: Path


def tls_broker(root: Path, server: Leaf, *extra: str) -> TlsBroker:
    """A broker with AMQPS on a free port, its certificate files copied (to be replaced)."""
    live = root / "live"
    live.mkdir(parents=True)
    shutil.copy(server.cert, live / "tls.crt")
    shutil.copy(server.key, live / "tls.key")
    port = free_port()
    broker = BrokerProcess(root / "data", name="tls")
    broker.extra_args = ["--tls-cert", str(live / "tls.crt"), "--tls-key", str(live / "tls.key"),
                         "--tls-port", str(port), *extra]  # fmt: skip
    return TlsBroker(broker, port, live)


@pytest.fixture
def broker(tmp_path: Path, ca: TestCA) -> Iterator[TlsBroker]:
    started = tls_broker(tmp_path, ca.issue("server"))
    with started.process.start():
        yield started


def client_context(ca: TestCA, leaf: Leaf | None = None) -> ssl.SSLContext:
    """What an application does: verify the broker's certificate against the CA."""
    context = ssl.create_default_context(cafile=str(ca.cert))
    if leaf is not None:
        context.load_cert_chain(leaf.cert, leaf.key)
    return context


def tls_params(broker: TlsBroker, context: ssl.SSLContext) -> pika.ConnectionParameters:
    return pika.ConnectionParameters(
        host="localhost",
        port=broker.port,
        ssl_options=pika.SSLOptions(context, "localhost"),
        connection_attempts=1,
    )


def served_certificate(broker: TlsBroker, ca: TestCA) -> bytes:
    """The DER certificate a new TLS connection to the AMQPS port is shown."""
    with (
        socket.create_connection(("127.0.0.1", broker.port)) as raw,
        client_context(ca).wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(leaf: Leaf) -> bytes:
    return ssl.PEM_cert_to_DER_cert(leaf.cert.read_text())


def test_pika_publishes_and_consumes_over_tls_beside_the_plain_port(
    broker: TlsBroker, ca: TestCA
) -> None:
    conn = pika.BlockingConnection(tls_params(broker, client_context(ca)))
    ch = conn.channel()
    ch.queue_declare("secure", durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", "secure", str(i).encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    # The plain port serves the same broker (a spec choice: beside, not instead).
    assert drain(broker.process.url, "secure") == [str(i).encode() for i in range(50)]


def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(
    broker: TlsBroker, tmp_path: Path
) -> None:
    stranger = TestCA(tmp_path / "other", name="someone else")
    with pytest.raises(REFUSED):
        pika.BlockingConnection(tls_params(broker, client_context(stranger)))


def test_with_a_ca_given_only_clients_with_a_certificate_it_signed_get_in(
    tmp_path: Path, ca: TestCA
) -> None:
    broker = tls_broker(tmp_path, ca.issue("server"), "--tls-ca", str(ca.cert))
    with broker.process.start():
        with pytest.raises(REFUSED):
            pika.BlockingConnection(tls_params(broker, client_context(ca)))  # no certificate
        stranger = TestCA(tmp_path / "other", name="someone else").issue("app", client=True)
        with pytest.raises(REFUSED):
            pika.BlockingConnection(tls_params(broker, client_context(ca, stranger)))
        app = ca.issue("app", client=True)
        conn = pika.BlockingConnection(tls_params(broker, client_context(ca, app)))
        conn.channel().queue_declare("mtls")
        conn.close()


def test_with_optional_client_certificates_a_client_may_present_none_but_never_a_stranger(
    tmp_path: Path, ca: TestCA
) -> None:
    broker = tls_broker(
        tmp_path, ca.issue("server"), "--tls-ca", str(ca.cert), "--tls-client-certs", "optional"
    )
    with broker.process.start():
        # An ordinary client: no certificate, its password is its login.
        plain = pika.BlockingConnection(tls_params(broker, client_context(ca)))
        plain.channel().queue_declare("optional-mtls", durable=True)
        plain.close()
        # A certificate presented is verified all the same: another CA's is refused.
        stranger = TestCA(tmp_path / "other", name="someone else").issue("app", client=True)
        with pytest.raises(REFUSED):
            pika.BlockingConnection(tls_params(broker, client_context(ca, stranger)))
        app = ca.issue("app", client=True)
        conn = pika.BlockingConnection(tls_params(broker, client_context(ca, app)))
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "optional-mtls", b"with a certificate")
        conn.close()
        assert drain(broker.process.url, "optional-mtls") == [b"with a certificate"]
    log = broker.process.log_path
    assert log is not None and "client certificates verified when presented" in log.read_text()


def test_client_certificates_optional_or_required_without_a_ca_are_refused_at_start_up(
    tmp_path: Path, ca: TestCA
) -> None:
    leaf = ca.issue("server")
    common = [sys.executable, "-m", "twinmq.broker.main", "--data-dir", str(tmp_path / "d"),
              "--port", "0", "--admin-port", "0", "--replication-port", "0",
              "--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key)]  # fmt: skip
    done = subprocess.run(
        [*common, "--tls-client-certs", "optional"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "--tls-client-certs optional needs --tls-ca" in done.stderr
    done = subprocess.run(
        [*common, "--tls-client-certs", "none", "--tls-ca", str(ca.cert)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--tls-client-certs none with --tls-ca" in done.stderr


def test_a_rotated_certificate_serves_new_connections_and_keeps_the_open_ones(
    broker: TlsBroker, ca: TestCA
) -> None:
    assert served_certificate(broker, ca) == der_of(Leaf(broker.live / "tls.crt", Path()))
    conn = pika.BlockingConnection(tls_params(broker, client_context(ca)))
    ch = conn.channel()
    ch.queue_declare("rotating", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "rotating", b"before", pika.BasicProperties(delivery_mode=2))

    renewed = ca.issue("server-renewed")
    live = broker.live
    # As cert-manager and the kubelet do: the new files replace the old ones in place.
    for source, name in ((renewed.key, "tls.key"), (renewed.cert, "tls.crt")):
        shutil.copy(source, live / (name + ".new"))
        (live / (name + ".new")).replace(live / name)
    new = der_of(renewed)
    wait_for("the new certificate served", lambda: served_certificate(broker, ca) == new)
    # The connection opened before the rotation was not dropped.
    ch.basic_publish("", "rotating", b"after", pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert drain(broker.process.url, "rotating") == [b"before", b"after"]
    log = broker.process.log_path
    assert log is not None and "TLS certificate reloaded" in log.read_text()


def test_a_certificate_without_its_key_is_a_clear_start_up_error(
    tmp_path: Path, ca: TestCA
) -> None:
    leaf = ca.issue("server")
    done = subprocess.run(
        [sys.executable, "-m", "twinmq.broker.main", "--data-dir", str(tmp_path / "d"),
         "--port", "0", "--admin-port", "0", "--replication-port", "0",
         "--tls-cert", str(leaf.cert)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--tls-cert and --tls-key go together" in done.stderr


def test_the_admin_api_answers_https_only_with_its_certificate(tmp_path: Path, ca: TestCA) -> None:
    leaf = ca.issue("admin")
    args = ["--admin-tls-cert", str(leaf.cert), "--admin-tls-key", str(leaf.key)]
    with BrokerProcess(tmp_path, name="admin-tls", extra_args=args).start() as broker:
        https = f"https://localhost:{broker.admin_port}"
        with SyncAdminClient(https, http=httpx.Client(verify=client_context(ca))) as admin:
            assert admin.readiness().ready  # the kubelet's probes: HTTPS too
            assert admin.status().role == ACTIVE
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{broker.admin_port}/healthz", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"{https}/healthz", timeout=5)
