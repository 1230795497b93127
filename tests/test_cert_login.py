"""Certificate login (SASL EXTERNAL, RabbitMQ's rabbitmq_auth_mechanism_ssl) on a real
broker over AMQPS, with real clients: the user is the name the verified client
certificate carries, must be in the users file, and is held to its permissions; EXTERNAL
is offered only on TLS with a verified certificate and `--tls-cert-login` on."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import kombu
import pika
import pika.exceptions
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pamqp import commands, frame
from test_tls import TlsBroker, client_context, tls_broker, tls_params

from twinmq.broker.auth import hash_password
from twinmq.broker.settings import parse_args
from twinmq.broker.tls import certificate_login_name
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.rawamqp import start_ok

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
GRANTS = [
    # `billing` (a certificate-only user) may use its own queues only.
    {"user": "billing", "vhost": "/", "configure": "^billing\\.",
     "write": "^(billing\\.|amq\\.default$)", "read": "^billing\\."},
    {"user": "alice", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
    {"user": "billing.example.com", "vhost": "/", "configure": ".*", "write": ".*",
     "read": ".*"},
]  # fmt: skip


def issue(
    ca: TestCA,
    name: str,
    *,
    dns: list[str] | None = None,
    email: list[str] | None = None,
    organization: str | None = None,
    server_too: bool = False,
) -> Leaf:
    """A client certificate signed by `ca` (common name `name`, the SANs given; with
    `server_too`, for client and server use, as a broker's own)."""
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, name)]
    if organization is not None:
        subject.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server_too:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    extensions: list[x509.ExtensionType] = [x509.ExtendedKeyUsage(usages)]
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns or []]
    sans += [x509.RFC822Name(e) for e in email or []]
    if sans:
        extensions.append(x509.SubjectAlternativeName(sans))
    return ca.sign(f"{name}-x", x509.Name(subject), extensions)


def users_file(path: Path) -> Path:
    """`billing` has no password (certificate login only), `alice` has one."""
    path.write_text(
        json.dumps(
            {
                "vhosts": [{"name": "/"}, {"name": "tenant-a"}],
                "users": [
                    {"name": "billing"},
                    {"name": "alice", "password_hash": hash_password("wonderland")},
                    {"name": "billing.example.com"},
                ],
                "permissions": GRANTS,
            }
        )
    )
    return path


def start(tmp_path: Path, ca: TestCA, apps: TestCA, login: str, *more: str) -> TlsBroker:
    extra = [f"--tls-ca={apps.cert}", "--tls-client-certs=optional",
             f"--users-file={users_file(tmp_path / 'users.json')}", *more]  # fmt: skip
    if login != "off":
        extra.append(f"--tls-cert-login={login}")
    return tls_broker(tmp_path, ca.issue("server"), *extra)


@pytest.fixture
def broker(tmp_path: Path, ca: TestCA, apps: TestCA) -> Iterator[TlsBroker]:
    started = start(tmp_path, ca, apps, "common_name")
    with started.process.start():
        yield started


def external(broker: TlsBroker, ca: TestCA, leaf: Leaf | None) -> pika.ConnectionParameters:
    params = tls_params(broker, client_context(ca, leaf))
    params.credentials = pika.credentials.ExternalCredentials()
    return params


def next_frame(sock: socket.socket, data: bytes) -> tuple[object, bytes]:
    """The next frame from `sock` (`data`: bytes already read), and the bytes after it."""
    while True:
        try:
            used, _, value = frame.unmarshal(data)
            return value, data[used:]
        except Exception:  # a frame not all here yet
            chunk = sock.recv(65536)
            assert chunk, "the broker closed the connection"
            data += chunk


def offered(port: int, context: ssl.SSLContext | None = None) -> list[str]:
    """The mechanisms connection.start offers on `port` (over TLS with `context`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        sock = raw if context is None else context.wrap_socket(raw, server_hostname="localhost")
        sock.sendall(PROTOCOL_HEADER)
        start, _ = next_frame(sock, b"")
    assert isinstance(start, commands.Connection.Start)
    return str(start.mechanisms).split()


def external_anyway(port: int) -> commands.Connection.Close:
    """What the broker answers a client that answers EXTERNAL on the plain port though it
    was not offered (a client of its own: pika would not send it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(PROTOCOL_HEADER)
        _, rest = next_frame(sock, b"")
        sock.sendall(start_ok("billing", "", mechanism="EXTERNAL"))
        close, _ = next_frame(sock, rest)
    assert isinstance(close, commands.Connection.Close)
    return close


def refusal(params: pika.ConnectionParameters) -> str:
    """Why the broker refuses the login (the reply text of its connection.close)."""
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as refused:
        pika.BlockingConnection(params)
    return str(refused.value)


def test_pika_logs_in_with_its_certificate_as_the_user_it_names_held_to_its_permissions(
    broker: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    conn = pika.BlockingConnection(external(broker, ca, issue(apps, "billing")))
    channel = conn.channel()
    channel.queue_declare("billing.invoices")
    channel.basic_publish("", "billing.invoices", b"due")
    method, _, body = channel.basic_get("billing.invoices", auto_ack=True)
    assert method is not None and body == b"due"
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
        channel.queue_declare("payroll")
    assert denied.value.reply_code == 403
    assert "billing" in denied.value.reply_text
    conn.close()


def test_external_is_offered_only_on_tls_with_a_verified_certificate(
    broker: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    assert "EXTERNAL" in offered(broker.port, client_context(ca, issue(apps, "billing")))
    assert offered(broker.port, client_context(ca)) == ["PLAIN", "AMQPLAIN"]  # no certificate
    assert offered(broker.process.port) == ["PLAIN", "AMQPLAIN"]  # plaintext
    refused = external_anyway(broker.process.port)
    assert refused.reply_code == 403 and "EXTERNAL is not offered" in refused.reply_text
    # And pika, asked for EXTERNAL where it is not offered, does not get in.
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(external(broker, ca, None))
    plain = pika.ConnectionParameters(
        host="127.0.0.1", port=broker.process.port, connection_attempts=1,
        credentials=pika.credentials.ExternalCredentials(),
    )  # fmt: skip
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(plain)


def test_a_certificate_naming_no_user_or_a_broker_is_refused_with_the_reason(
    broker: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    assert "no user 'stranger'" in refusal(external(broker, ca, issue(apps, "stranger")))
    assert "built-in user" in refusal(external(broker, ca, issue(apps, "guest")))
    broker_own = issue(apps, "billing", server_too=True)
    assert "replication identity" in refusal(external(broker, ca, broker_own))
    metrics = broker.process.admin.metrics()
    assert "twinmq_auth_failures_total 3.0" in metrics


def test_a_user_without_a_password_never_logs_in_with_one_but_others_still_do(
    broker: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    for password in ("", "guest"):
        params = tls_params(broker, client_context(ca))
        params.credentials = pika.PlainCredentials("billing", password)
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            pika.BlockingConnection(params)
    params = tls_params(broker, client_context(ca, issue(apps, "billing")))
    params.credentials = pika.PlainCredentials("alice", "wonderland")
    conn = pika.BlockingConnection(params)  # a certificate does not stop a password login
    conn.channel().queue_declare("anything")
    conn.close()


def test_with_certificate_login_off_external_is_not_offered(
    tmp_path: Path, ca: TestCA, apps: TestCA
) -> None:
    off = start(tmp_path, ca, apps, "off")
    with off.process.start():
        assert offered(off.port, client_context(ca, issue(apps, "billing"))) == [
            "PLAIN", "AMQPLAIN",
        ]  # fmt: skip
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            pika.BlockingConnection(external(off, ca, issue(apps, "billing")))


def test_the_name_comes_from_a_subject_alternative_name_when_configured(
    tmp_path: Path, ca: TestCA, apps: TestCA
) -> None:
    san = start(tmp_path, ca, apps, "san_dns")
    with san.process.start():
        leaf = issue(apps, "whoever", dns=["billing.example.com", "second.example.com"])
        conn = pika.BlockingConnection(external(san, ca, leaf))
        conn.channel().queue_declare("anything")  # billing.example.com may do anything
        conn.close()
        reason = refusal(external(san, ca, issue(apps, "billing")))  # a CN, no DNS name
        assert "no DNS subject alternative name" in reason


def test_aio_pika_and_kombu_log_in_with_external(
    broker: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    leaf = issue(apps, "billing")

    async def aio() -> None:
        connection = await aio_pika.connect(
            f"amqps://localhost:{broker.port}/?auth=external",
            ssl_context=client_context(ca, leaf),
        )
        async with connection:
            channel = await connection.channel()
            await channel.declare_queue("billing.aio")

    asyncio.run(aio())
    with kombu.Connection(
        f"amqp://localhost:{broker.port}//",
        login_method="EXTERNAL",
        ssl={"ca_certs": str(ca.cert), "certfile": str(leaf.cert), "keyfile": str(leaf.key),
             "cert_reqs": ssl.CERT_REQUIRED, "server_hostname": "localhost"},
        connect_timeout=10,
    ) as conn:  # fmt: skip
        conn.connect()
        conn.default_channel.queue_declare("billing.kombu")


def test_a_certificate_login_is_held_to_the_users_vhosts_and_connection_limit(
    tmp_path: Path, ca: TestCA, apps: TestCA
) -> None:
    limited = start(tmp_path, ca, apps, "common_name", "--max-connections-per-user=1")
    leaf = issue(apps, "billing")
    with limited.process.start():
        elsewhere = external(limited, ca, leaf)
        elsewhere.virtual_host = "tenant-a"  # billing has no permission there
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as denied:
            pika.BlockingConnection(elsewhere)
        assert "access to vhost 'tenant-a' refused for user 'billing'" in str(denied.value)
        first = pika.BlockingConnection(external(limited, ca, leaf))
        with pytest.raises(pika.exceptions.AMQPConnectionError) as second:
            pika.BlockingConnection(external(limited, ca, leaf))
        assert "reached its limit of 1 connections" in str(second.value)
        first.close()


def test_each_source_takes_the_name_rabbitmq_would(tmp_path: Path, apps: TestCA) -> None:
    leaf = issue(apps, "billing", organization="Example", dns=["b.example.com", "c.example.com"],
                 email=["billing@example.com"])  # fmt: skip
    cert = x509.load_pem_x509_certificate(leaf.cert.read_bytes())
    assert certificate_login_name(cert, "common_name") == "billing"
    # RFC 4514, most specific first: what RabbitMQ's distinguished_name gives.
    assert certificate_login_name(cert, "distinguished_name") == "CN=billing,O=Example"
    assert certificate_login_name(cert, "san_dns") == "b.example.com"
    assert certificate_login_name(cert, "san_email") == "billing@example.com"
    bare = x509.load_pem_x509_certificate(issue(apps, "bare").cert.read_bytes())
    assert certificate_login_name(bare, "san_email") is None


def test_certificate_login_without_verified_client_certificates_is_a_start_up_error(
    tmp_path: Path,
) -> None:
    tls = ["--tls-cert", str(tmp_path / "c"), "--tls-key", str(tmp_path / "k")]
    with pytest.raises(ValueError, match="needs client certificates verified"):
        parse_args([*tls, "--tls-cert-login", "common_name"])
    with pytest.raises(ValueError, match="needs client certificates verified"):
        parse_args([*tls, "--tls-client-certs", "none", "--tls-cert-login", "common_name"])
    settings = parse_args([*tls, "--tls-ca", "ca", "--tls-cert-login", "san_dns"])
    assert settings.tls_cert_login == "san_dns"
    with pytest.raises(ValueError, match="tls_cert_login"):
        parse_args([*tls, "--tls-ca", "ca", "--tls-cert-login", "user_id"])
