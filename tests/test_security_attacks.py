"""Attacks on TwinMQ's authentication and authorisation (docs/security.md, "Attacks tried"),
each against a real broker process with real clients (pika; raw sockets for what pika
would never send): an attacker who holds a client certificate our applications' CA signed
for some user, the admin API's read-only token, or a user with narrow permissions. Each
test is what would catch the hole coming back."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pika
import pika.exceptions
import pytest
from apiserver import install_crd
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes.client.exceptions import ApiException
from pamqp import commands
from pika.adapters.blocking_connection import BlockingChannel
from test_cert_login import PROTOCOL_HEADER, external, next_frame, refusal
from test_tls import TlsBroker, client_context, tls_broker

from twinmq.broker.auth import hash_password
from twinmq.broker.names import ADMIN_TOKEN_ENV, setting_env
from twinmq.operator import main as operator_main
from twinmq.operator.admission import binding, policy
from twinmq.operator.builders import ClusterRef
from twinmq.operator.kube import Kube
from twinmq.operator.models import GROUP, KIND, PLURAL, VERSION, BrokerClusterSpec
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import encode, start_ok
from twinmq.testing.waiting import wait_for

ALICE_DN = "CN=alice,O=x"  # a user named by a whole distinguished name
USERS = {
    "vhosts": [{"name": "/"}],
    "users": [
        {"name": "alice", "password_hash": hash_password("wonderland")},
        {"name": "billing"},  # certificate only
        {"name": ALICE_DN},  # certificate only, for `--tls-cert-login distinguished_name`
    ],
    "permissions": [
        {"user": "alice", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
        {"user": ALICE_DN, "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
        # `billing` may use its own queues and publish through its own exchanges only.
        {"user": "billing", "vhost": "/", "configure": "^billing\\.", "write": "^billing\\.",
         "read": "^billing\\."},
    ],
}  # fmt: skip


def crafted(
    ca: TestCA,
    label: str,
    subject: x509.Name,
    *usages: x509.ObjectIdentifier,
    any_use: bool = False,
) -> Leaf:
    """A certificate `ca` signs for exactly `subject` (the extended key usages given, client
    authentication if none; `any_use`: no extended key usage at all): what an attacker
    holds is whatever our CA was made to sign."""
    if any_use:
        return ca.sign(label, subject, [])
    eku = x509.ExtendedKeyUsage(list(usages) or [ExtendedKeyUsageOID.CLIENT_AUTH])
    return ca.sign(label, subject, [eku])


def cn(value: str, string_type: x509.name._ASN1Type | None = None) -> x509.NameAttribute[str]:
    if string_type is None:
        return x509.NameAttribute(NameOID.COMMON_NAME, value)
    return x509.NameAttribute(NameOID.COMMON_NAME, value, string_type)


def start(tmp_path: Path, ca: TestCA, apps: TestCA, login: str) -> TlsBroker:
    users = tmp_path / "users.json"
    users.write_text(json.dumps(USERS))
    return tls_broker(tmp_path, ca.issue("server"), f"--tls-ca={apps.cert}",
                      "--tls-client-certs=optional", f"--users-file={users}",
                      f"--tls-cert-login={login}")  # fmt: skip


@pytest.fixture
def by_cn(tmp_path: Path, ca: TestCA, apps: TestCA) -> Iterator[TlsBroker]:
    """A broker taking the user from the common name."""
    started = start(tmp_path, ca, apps, "common_name")
    with started.process.start():
        yield started


# -- EXTERNAL: names crafted to collide with another user ---------------------------------


def test_a_common_name_differing_by_case_whitespace_a_nul_or_a_second_cn_is_not_the_user(
    by_cn: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    near_misses = {
        "case": x509.Name([cn("Billing")]),
        "space": x509.Name([cn("billing ")]),
        "nul": x509.Name([cn("billing\x00")]),
        "nul-prefix": x509.Name([cn("billing\x00alice")]),
        # Two common names: the first (in the certificate's order) is the name, as in
        # RabbitMQ; a CA that signed `CN=stranger` first does not make it `alice` too.
        "second-cn": x509.Name([cn("stranger"), cn("alice")]),
    }
    for label, subject in near_misses.items():
        reason = refusal(external(by_cn, ca, crafted(apps, label, subject)))
        assert "no user" in reason, (label, reason)
    # The same name as a BMPString (UCS-2) is the same user: the name is compared as text.
    bmp = crafted(apps, "bmp", x509.Name([cn("billing", x509.name._ASN1Type.BMPString)]))
    conn = pika.BlockingConnection(external(by_cn, ca, bmp))
    conn.channel().queue_declare("billing.bmp")
    conn.close()


def test_a_certificate_for_server_use_only_or_for_both_uses_is_no_login(
    by_cn: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    """A server's certificate (`serverAuth` only) does not pass as a client's: the handshake
    fails. One for both uses (a broker's, a mirror's, the operator's federation client
    certificates) passes the handshake but is refused as a login."""
    billing = x509.Name([cn("billing")])
    server_only = crafted(apps, "server-only", billing, ExtendedKeyUsageOID.SERVER_AUTH)
    with pytest.raises(pika.exceptions.AMQPConnectionError) as failed:
        pika.BlockingConnection(external(by_cn, ca, server_only))
    assert not isinstance(failed.value, pika.exceptions.ProbableAuthenticationError)
    both = crafted(apps, "both", billing, ExtendedKeyUsageOID.SERVER_AUTH,
                   ExtendedKeyUsageOID.CLIENT_AUTH)  # fmt: skip
    assert "replication identity" in refusal(external(by_cn, ca, both))
    # No extended key usage at all is good for any use: RabbitMQ and TwinMQ take it.
    pika.BlockingConnection(
        external(by_cn, ca, crafted(apps, "any-use", billing, any_use=True))
    ).close()


def test_a_distinguished_name_with_an_escaped_comma_or_a_multi_valued_rdn_is_not_the_user(
    tmp_path: Path, ca: TestCA, apps: TestCA
) -> None:
    by_dn = start(tmp_path, ca, apps, "distinguished_name")
    org = x509.NameAttribute(NameOID.ORGANIZATION_NAME, "x")
    with by_dn.process.start():
        spelled = {
            # One common name `alice,O=x`: RFC 4514 writes `CN=alice\,O=x`.
            "escaped-comma": x509.Name([cn("alice,O=x")]),
            # One RDN holding both attributes: `CN=alice+O=x`, not two RDNs.
            "multi-valued": x509.Name([x509.RelativeDistinguishedName([cn("alice"), org])]),
            # The RDNs in the other order: `O=x,CN=alice`.
            "reversed": x509.Name([cn("alice"), org]),
            "trailing-space": x509.Name([org, cn("alice ")]),
        }
        for label, subject in spelled.items():
            reason = refusal(external(by_dn, ca, crafted(apps, label, subject)))
            assert "no user" in reason, (label, reason)
        genuine = crafted(apps, "genuine", x509.Name([org, cn("alice")]))
        conn = pika.BlockingConnection(external(by_dn, ca, genuine))  # CN=alice,O=x
        conn.channel().queue_declare("dn.genuine")
        conn.close()


def external_as(broker: TlsBroker, ca: TestCA, leaf: Leaf, authzid: str) -> object:
    """What the broker answers an EXTERNAL start-ok whose response (the SASL
    authorization identity) is `authzid`, over TLS with `leaf` (a client of its own)."""
    with (
        socket.create_connection(("127.0.0.1", broker.port), timeout=10) as raw,
        client_context(ca, leaf).wrap_socket(raw, server_hostname="localhost") as sock,
    ):
        sock.sendall(PROTOCOL_HEADER)
        _, rest = next_frame(sock, b"")
        sock.sendall(
            encode(
                0,
                commands.Connection.StartOk(
                    client_properties={"product": "attacker"},
                    mechanism="EXTERNAL",
                    response=authzid,
                ),
            )
        )
        answer, _ = next_frame(sock, rest)
    return answer


def test_external_with_another_users_authorization_identity_is_refused(
    by_cn: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    billing = crafted(apps, "billing", x509.Name([cn("billing")]))
    for authzid in ("alice", "billing\x00alice", "Billing"):
        close = external_as(by_cn, ca, billing, authzid)
        assert isinstance(close, commands.Connection.Close), authzid
        assert close.reply_code == 403 and "not the" in close.reply_text, close.reply_text
    # Its own name, or none, is what RFC 4422 allows: the login goes on (connection.tune).
    for authzid in ("billing", ""):
        assert isinstance(external_as(by_cn, ca, billing, authzid), commands.Connection.Tune)


def test_a_client_cannot_renegotiate_tls_to_change_its_certificate_mid_connection(
    by_cn: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    """TLS 1.2's renegotiation would let a client present another certificate after the
    login took the first (and costs the server a handshake per request): the listener
    refuses it. TLS 1.3 has no renegotiation, and the broker never asks for post-handshake
    authentication."""
    billing = crafted(apps, "billing", x509.Name([cn("billing")]))
    ran = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{by_cn.port}", "-tls1_2",
         "-cert", str(billing.cert), "-key", str(billing.key), "-CAfile", str(ca.cert)],
        input=b"R\n", capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert b"RENEGOTIATING" in ran.stderr  # the client asked (`R`: renegotiate)
    assert b"no renegotiation" in ran.stderr, ran.stderr.decode(errors="replace")


def login_refused(params: pika.ConnectionParameters) -> str | None:
    """Why a login is refused, or None if it gets in (the connection is closed again)."""
    try:
        pika.BlockingConnection(params).close()
    except pika.exceptions.ProbableAuthenticationError as exc:
        return str(exc)
    return None


def test_a_user_removed_from_the_users_file_loses_every_right_on_an_open_connection(
    tmp_path: Path, by_cn: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    billing = crafted(apps, "billing", x509.Name([cn("billing")]))
    conn = pika.BlockingConnection(external(by_cn, ca, billing))
    channel = conn.channel()
    channel.queue_declare("billing.kept")
    users = tmp_path / "users.json"
    without = {
        **USERS,
        "users": [u for u in USERS["users"] if u["name"] != "billing"],
        "permissions": [p for p in USERS["permissions"] if p["user"] != "billing"],
    }
    users.write_text(json.dumps(without))
    wait_for("billing removed", lambda: login_refused(external(by_cn, ca, billing)), 30)
    # RabbitMQ keeps a deleted user's connections open too; here each operation is checked
    # against the permissions now in force, and the removed user has none.
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
        channel.queue_declare("billing.after")
    assert denied.value.reply_code == 403
    print("OPEN?", conn.is_open)
    channel = conn.channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
        channel.basic_get("billing.kept")
    assert denied.value.reply_code == 403
    conn.close()


def test_without_a_permissions_list_a_removed_user_loses_its_rights_on_an_open_connection(
    tmp_path: Path,
) -> None:
    """A users file without `permissions` lets every user do everything: every user *in
    the file*. One removed from it keeps its open connection (as in RabbitMQ), not its
    rights."""
    users = tmp_path / "users.json"
    everyone = {"users": [{"name": "alice", "password": "wonderland"},
                          {"name": "bob", "password": "builder"}]}  # fmt: skip
    users.write_text(json.dumps(everyone))
    broker = BrokerProcess(tmp_path / "data", name="open", extra_args=["--users-file", str(users)])
    with broker:
        params = pika.ConnectionParameters(
            "127.0.0.1", broker.port, credentials=pika.PlainCredentials("alice", "wonderland")
        )
        conn = pika.BlockingConnection(params)
        channel = conn.channel()
        channel.queue_declare("alice.before")
        users.write_text(json.dumps({"users": everyone["users"][1:]}))
        wait_for("alice removed", lambda: login_refused(params), 30)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
            channel.queue_declare("alice.after")
        assert denied.value.reply_code == 403
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
            conn.channel().basic_get("alice.before")
        assert denied.value.reply_code == 403
        conn.close()


# -- passwords: a certificate-only user reached without its certificate --------------------


def test_a_certificate_only_user_is_never_reached_with_a_password_of_any_shape(
    by_cn: TlsBroker,
) -> None:
    for mechanism in ("PLAIN", "AMQPLAIN"):
        for password in ("", " ", "\x00", "None", "null"):
            with socket.create_connection(("127.0.0.1", by_cn.process.port), timeout=10) as sock:
                sock.sendall(PROTOCOL_HEADER)
                _, rest = next_frame(sock, b"")
                sock.sendall(start_ok("billing", password, mechanism=mechanism))
                close, _ = next_frame(sock, rest)
            assert isinstance(close, commands.Connection.Close), (mechanism, password)
            assert close.reply_code == 403, (mechanism, password, close.reply_text)


# -- the admin API's read-only token ------------------------------------------------------

TOKEN, READ_TOKEN = "full-t0ken", "read-0nly"
MUTATIONS = [("POST", "/role", {"role": "passive", "epoch": 10**6}),
             ("POST", "/mirror/demote", {}), ("POST", "/mirror/promote", {}),
             ("POST", "/mirror/reseed", {}), ("DELETE", "/vhosts/%2F", None)]  # fmt: skip


def raw_http(port: int, request: bytes) -> bytes:
    """The status line the admin API answers a request written byte for byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_the_read_only_admin_token_changes_nothing_whatever_the_headers_or_path_say(
    tmp_path: Path,
) -> None:
    broker = BrokerProcess(
        tmp_path / "data", name="admin",
        env={ADMIN_TOKEN_ENV: TOKEN, setting_env("admin_read_token"): READ_TOKEN},
    )  # fmt: skip
    with broker:
        before = broker.admin.status()
        spellings = [
            [("Authorization", f"Bearer {READ_TOKEN}")],
            # Two headers, the full token second: the first is the one read.
            [("Authorization", f"Bearer {READ_TOKEN}"), ("Authorization", f"Bearer {TOKEN}")],
            [("authorization", f"Bearer {READ_TOKEN}")],
        ]
        with httpx.Client(base_url=broker.admin_url, timeout=10) as http:
            for method, path, body in MUTATIONS:
                for headers in spellings:
                    answer = http.request(method, path, json=body, headers=headers)
                    assert answer.status_code == 403, (method, path, headers, answer.text)
            # The full token in another case, with other whitespace, or not as a bearer.
            for value in (f"bearer {TOKEN}", f"Bearer  {TOKEN}", f"Basic {TOKEN}", TOKEN,
                          f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x"):  # fmt: skip
                answer = http.post("/role", json=MUTATIONS[0][2], headers={"Authorization": value})
                assert answer.status_code == 401, (value, answer.text)
        # Paths that spell an open one (/healthz) but might route to another, no token.
        for spelled in (b"/healthz/../role", b"/healthz/%2e%2e/role", b"//role", b"/role?/healthz",
                     b"/ROLE", b"/role/", b"/healthz#/role"):  # fmt: skip
            status = raw_http(broker.admin_port, b"POST " + spelled + b" HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")  # fmt: skip
            assert status.split()[1] in (b"400", b"401", b"404", b"405"), (spelled, status)
        after = broker.admin.status()
        assert (after.role, after.epoch) == (before.role, before.epoch)


# -- permissions: a narrow user reaching what it may not -----------------------------------

NARROW = {
    "users": [{"name": "owner", "password": "owner-pw"}, {"name": "narrow", "password": "n-pw"}],
    "permissions": [
        {"user": "owner", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
        {"user": "narrow", "vhost": "/", "configure": "^narrow\\.", "write": "^narrow\\.",
         "read": "^narrow\\."},
    ],
}  # fmt: skip


def test_a_narrow_user_cannot_reach_another_users_queue_by_any_side_door(tmp_path: Path) -> None:
    users = tmp_path / "users.json"
    users.write_text(json.dumps(NARROW))
    broker = BrokerProcess(tmp_path / "data", name="perm", extra_args=["--users-file", str(users)])

    def connect(user: str, password: str) -> pika.BlockingConnection:
        credentials = pika.PlainCredentials(user, password)
        return pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", broker.port, credentials=credentials)
        )

    with broker:
        owner = connect("owner", "owner-pw").channel()
        owner.queue_declare("payroll")
        owner.exchange_declare("payroll.x", "fanout")
        owner.queue_bind("payroll", "payroll.x")
        narrow = connect("narrow", "n-pw")
        narrow.channel().exchange_declare("narrow.x", "fanout")
        attempts: dict[str, Callable[[BlockingChannel], object]] = {
            # Dead-lettering into the owner's exchange, or through the default exchange.
            "dlx": lambda ch: ch.queue_declare(
                "narrow.dl", arguments={"x-dead-letter-exchange": "payroll.x"}),
            "dlx-default": lambda ch: ch.queue_declare("narrow.dl2", arguments={
                "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "payroll"}),
            # Publishing through the default exchange (RabbitMQ's `amq.default` write).
            "default-exchange": lambda ch: (ch.confirm_delivery(),
                                            ch.basic_publish("", "payroll", b"forged")),
            # Binding the owner's queue to an exchange of its own (write on the queue).
            "bind-their-queue": lambda ch: ch.queue_bind("payroll", "narrow.x"),
            # Binding a queue of its own to the owner's exchange (read on the exchange).
            "bind-their-exchange": lambda ch: (ch.queue_declare("narrow.tap"),
                                               ch.queue_bind("narrow.tap", "payroll.x")),
            "server-named": lambda ch: ch.queue_declare(""),  # `amq.gen`, not `narrow.`
            "get": lambda ch: ch.basic_get("payroll"),
            "purge": lambda ch: ch.queue_purge("payroll"),
            "delete": lambda ch: ch.queue_delete("payroll"),
        }  # fmt: skip
        for label, attempt in attempts.items():
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
                attempt(narrow.channel())
            assert denied.value.reply_code == 403, (label, denied.value)
        # A dead-letter exchange given as bytes (a field of another type) is refused as
        # malformed, not let past the write check that reads only strings.
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as malformed:
            narrow.channel().queue_declare(
                "narrow.dl3", arguments={"x-dead-letter-exchange": b"payroll.x"}
            )
        assert malformed.value.reply_code == 406
        # An alternate exchange would route around the write check: it is not acted on.
        side = narrow.channel()
        side.exchange_declare("narrow.ae", "direct", arguments={"alternate-exchange": "payroll.x"})
        side.confirm_delivery()
        side.basic_publish("narrow.ae", "nowhere", b"unroutable")
        # A passive declare needs no permission (RabbitMQ's table): it tells only that the
        # queue exists, and how many messages it holds.
        assert narrow.channel().queue_declare("payroll", passive=True).method.queue == "payroll"
        assert owner.queue_declare("payroll", passive=True).method.message_count == 0
        # Exchange-to-exchange bindings (write on the destination) are not served at all.
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e2e:
            narrow.channel().exchange_bind("payroll.x", "narrow.x")
        assert e2e.value.reply_code == 540


# -- federation's headers: a client claiming to be a federation link -----------------------

FEDERATION_HEADERS = ("x-twinmq-origin", "x-twinmq-origin-seq", "x-twinmq-federation-path")


def test_a_client_announcing_a_server_id_must_be_a_federation_links_user(
    tmp_path: Path,
) -> None:
    """An ordinary user (write on one exchange) that says it is a federation peer (the
    client property `x-twinmq-server-id`): were it taken for a link, a message it
    publishes under another site's (origin, seq) would keep those headers and claim that
    key, and the real site's message of that number would be dropped as a copy when its
    link forwards it. Only a user tagged `federation` may announce a server id: this one
    is refused at login with the reason, and a plain client of the same user publishes
    with the headers stripped (`strip_federation`), twice, two messages."""
    users = tmp_path / "users.json"
    users.write_text(json.dumps(NARROW))
    broker = BrokerProcess(tmp_path / "data", name="fed", extra_args=["--users-file", str(users)])
    with broker:
        owner = pika.BlockingConnection(pika.ConnectionParameters(
            "127.0.0.1", broker.port, credentials=pika.PlainCredentials("owner", "owner-pw"),
        )).channel()  # fmt: skip
        owner.exchange_declare("narrow.orders", "fanout")
        owner.queue_declare("narrow.orders.q")
        owner.queue_bind("narrow.orders.q", "narrow.orders")
        credentials = pika.PlainCredentials("narrow", "n-pw")
        with pytest.raises(pika.exceptions.AMQPConnectionError) as refused:
            pika.BlockingConnection(pika.ConnectionParameters(
                "127.0.0.1", broker.port, credentials=credentials,
                client_properties={"x-twinmq-server-id": "not-a-peer"},
            ))  # fmt: skip
        assert "not a federation link's user" in str(refused.value), refused.value
        plain = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", broker.port, credentials=credentials)
        )
        channel = plain.channel()
        channel.confirm_delivery()
        forged = {"x-twinmq-origin": "site-b", "x-twinmq-origin-seq": 7}
        for body in (b"first", b"second"):  # the same key twice
            channel.basic_publish("narrow.orders", "", body, pika.BasicProperties(headers=forged))
        got = []
        while (message := owner.basic_get("narrow.orders.q", auto_ack=True))[0] is not None:
            got.append((message[2], dict(message[1].headers or {})))
        plain.close()
    assert [body for body, _ in got] == [b"first", b"second"], "a forged key was honoured"
    for _, headers in got:
        assert not set(headers) & set(FEDERATION_HEADERS), headers


# -- operator admission: what the operator would do on a BrokerCluster author's behalf -----

ADMISSION_NS = "secattack"


@pytest.fixture(scope="module")
def authors(kube_apiserver: Any) -> Kube:
    """The admission policy on a real API server, and two authors in `ADMISSION_NS` who
    may create BrokerClusters and pods: `builder`, and `certifier`, who may also create
    cert-manager Certificates; and `no-pods`, whom only the policy refuses."""
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    namespace: Any = {"metadata": {"name": ADMISSION_NS}}  # the client takes plain dicts
    api.core.create_namespace(namespace)
    clusters = {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["create", "get"]}
    pods = {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}
    certificates = {"apiGroups": ["cert-manager.io"], "resources": ["certificates"],
                    "verbs": ["create"]}  # fmt: skip
    for user, rules in (
        ("builder", [clusters, pods]),
        ("certifier", [clusters, pods, certificates]),
        ("no-pods", [clusters]),
    ):
        meta = {"name": user, "namespace": ADMISSION_NS}
        api.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": meta, "rules": rules})  # fmt: skip
        api.apply({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        })  # fmt: skip
    api.apply(policy())
    api.apply(binding())
    return api


def created_as(kube_apiserver: Any, user: str, spec: dict[str, Any]) -> str | None:
    """Why the API server refuses `user`'s BrokerCluster of `spec` (dry run), or None."""
    api = Kube(str(kube_apiserver.kubeconfig))
    api.api.set_default_header("Impersonate-User", user)  # type: ignore[no-untyped-call]
    resource = api.dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=KIND)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": "attack", "namespace": ADMISSION_NS}, "spec": spec}  # fmt: skip
    try:
        resource.create(body=body, namespace=ADMISSION_NS, query_params=[("dryRun", "All")])
    except ApiException as exc:
        return str(exc.body)
    return None


def test_naming_a_cert_manager_issuer_needs_the_right_to_create_certificates(
    authors: Kube, kube_apiserver: Any
) -> None:
    # The policy is in force once it refuses what only it refuses (RBAC lets `no-pods`
    # create BrokerClusters). `nobody` was refused by RBAC alone: that wait passed before
    # the API server had loaded the policy, and `builder` was admitted now and then.
    wait_for(
        "the policy in force",
        lambda: "may not create pods" in (created_as(kube_apiserver, "no-pods", {}) or ""),
        30,
    )
    spec = {"tls": {"issuerRef": {"name": "corporate-ca", "kind": "ClusterIssuer"}}}
    assert created_as(kube_apiserver, "certifier", spec) is None
    refused = created_as(kube_apiserver, "builder", spec)
    assert refused is not None and "certificates" in refused, refused


def test_a_cluster_never_takes_over_a_secret_it_did_not_create_under_its_generated_name(
    authors: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An author who may create BrokerClusters but not touch Secrets names a cluster after
    someone else's Secret (`payments` for `payments-auth`): the operator must leave that
    Secret alone, not rewrite it and own it (its garbage collector would delete it with the
    cluster)."""
    victim = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": {"name": "payments-auth", "namespace": ADMISSION_NS},
              "stringData": {"api-key": "the payments team's"}}  # fmt: skip
    authors.apply(victim)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": "payments", "namespace": ADMISSION_NS}, "spec": {}}  # fmt: skip
    created = authors.dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=KIND).create(
        body=body, namespace=ADMISSION_NS
    )
    cluster = ClusterRef("payments", ADMISSION_NS, created.metadata.uid)
    monkeypatch.setattr(operator_main, "KUBE", authors)
    with contextlib.suppress(Exception):  # what else a pass does needs no node; the Secret is first
        operator_main.reconcile_children(cluster, BrokerClusterSpec(), operator_main.Memory(), {})
    after = authors.get("v1", "Secret", ADMISSION_NS, "payments-auth")
    assert after is not None
    assert not after["metadata"].get("ownerReferences"), after["metadata"]["ownerReferences"]
    assert set(after["data"]) == {"api-key"}, sorted(after["data"])
