"""Whose CA may log a client in (SASL EXTERNAL) on a federation upstream (issue 16).

An upstream with certificate login on (`spec.tls.clientCertificates.login`) also verifies
its federation downstreams' client certificates. A downstream's CA is a Secret in the
downstream's namespace: whoever can read it there can mint a certificate for any name. So
the downstreams' CAs go beside the applications' bundle (`--tls-federation-ca`), trusted
for the TLS handshake only: the applications' CA still logs in as the certificate's name,
a downstream's CA is refused (403, with the reason) whatever it names, and the
downstream's federation link (its certificate, its password) still runs. A real broker
started with the flags the operator builds, real pika, a real federation link.
"""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

import pika
import pika.exceptions
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from federationsites import (
    PASSWORD_ENV,
    bind_queue,
    links,
    publish_confirmed,
    queue_depth,
    site,
    wait_running,
)
from pamqp import commands, frame
from test_cert_login import PROTOCOL_HEADER, external, issue, next_frame
from test_tls import TlsBroker, client_context, tls_broker, tls_params
from test_tls_client_ca import BundleVolume, connects

from twinmq.broker import names
from twinmq.broker.auth import hash_password
from twinmq.broker.settings import parse_args
from twinmq.operator import federation, federationtls
from twinmq.operator.builders import (
    CLIENT_CA_DIR,
    PEER_TLS_DIR,
    TLS_DIR,
    ClusterRef,
    build_pod,
)
from twinmq.operator.models import BrokerClusterSpec
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import free_port
from twinmq.testing.waiting import wait_for

CLUSTER = ClusterRef(namespace="site-a", name="central", uid="uid-1")
ADMIN_PASSWORD = "admin-secret"
LINK_USER = "twinmq-federation"


@pytest.fixture
def downstream(tmp_path: Path) -> TestCA:
    """A federation downstream's CA (another tenant's namespace holds its key)."""
    return TestCA(tmp_path / "downstream-pki", name="downstream site CA")


def upstream_spec() -> BrokerClusterSpec:
    """An upstream asking applications for certificates that log in, with the downstreams'
    CAs the operator copied (`federationtls.effective` names the copy)."""
    raw = BrokerClusterSpec.model_validate({
        "tls": {"clientCertificates": {"mode": "optional", "caConfigMap": "apps-ca",
                                       "login": "commonName"}},
        "federation": {},
    })  # fmt: skip
    copy = federationtls.downstream_ca_name(CLUSTER.name)
    trust = federationtls.Trust(
        downstream=federationtls.DownstreamTrust("m", "CAS", ("site-b/remote",), copy)
    )
    return federationtls.effective(CLUSTER, raw, trust)


def operator_tls_args(spec: BrokerClusterSpec) -> list[str]:
    """The AMQPS flags of the broker container the operator builds for `spec`."""
    args: list[str] = build_pod(CLUSTER, spec, "primary")["spec"]["containers"][0]["args"]
    return [a for a in args if a.startswith("--tls-")]


def on_disk(args: list[str], files: dict[str, Path]) -> list[str]:
    """`args` with the container's mounted directories replaced by local files: each
    directory's `ca.crt` (or `tls.crt`, `tls.key`) from `files[directory]`'s folder."""
    out = []
    for arg in args:
        for directory, local in files.items():
            arg = arg.replace(f"={directory}/", f"={local}/")
        out.append(arg)
    return out


def mounted(folder: Path, **files: Path) -> Path:
    """A folder holding `files` under the names the pod mounts them (a volume's items)."""
    folder.mkdir(parents=True)
    for name, source in files.items():
        (folder / name.replace("_", ".")).write_bytes(source.read_bytes())
    return folder


def users_file(path: Path) -> Path:
    """`admin` (a password), `billing` (certificate login only) and the federation links'
    user (tagged `federation`, a password)."""
    path.write_text(json.dumps({"users": [
        {"name": "admin", "password_hash": hash_password(ADMIN_PASSWORD)},
        {"name": "billing"},
        {"name": "guest", "password": "guest"},
        {"name": LINK_USER, "password": "link-secret", "tags": ["federation"]},
    ]}))  # fmt: skip
    return path


def upstream_broker(
    tmp_path: Path, ca: TestCA, apps: TestCA, downstream_bundle: Path | BundleVolume
) -> TlsBroker:
    """A broker with exactly the operator's AMQPS flags for `upstream_spec`, the pod's
    mounted files here: the server certificate, the applications' bundle, the downstreams'
    (a file copied, or a volume the test updates as the kubelet does)."""
    server = ca.issue("server")
    files = {
        TLS_DIR: mounted(tmp_path / "tls", tls_crt=server.cert, tls_key=server.key),
        CLIENT_CA_DIR: mounted(tmp_path / "client-ca", ca_crt=apps.cert),
        federation.DOWNSTREAM_CA_DIR: downstream_bundle.folder
        if isinstance(downstream_bundle, BundleVolume)
        else mounted(tmp_path / "downstream-ca", ca_crt=downstream_bundle),
    }
    args = on_disk(operator_tls_args(upstream_spec()), files)
    # `tls_broker` gives its own --tls-cert/--tls-key (a copy it may replace).
    args = [a for a in args if not a.startswith(("--tls-cert=", "--tls-key="))]
    users = users_file(tmp_path / "users.json")
    return tls_broker(tmp_path, server, *args, f"--users-file={users}")


def keyed(ca: TestCA, name: str) -> Leaf:
    """A client certificate for `name` naming its signer's key (authority key identifier),
    so that OpenSSL picks `ca` among CAs of the same name and the handshake verifies."""
    signer = x509.load_pem_x509_certificate(ca.cert.read_bytes()).public_key()
    assert isinstance(signer, rsa.RSAPublicKey)
    return ca.sign(f"{name}-keyed", x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), [
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
        x509.AuthorityKeyIdentifier.from_issuer_public_key(signer),
    ])  # fmt: skip


def refusal(params: pika.ConnectionParameters) -> str:
    """Why the broker refuses the login (the reply text of its connection.close)."""
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as refused:
        pika.BlockingConnection(params).close()
    return str(refused.value)


def external_close(port: int, context: ssl.SSLContext) -> commands.Connection.Close:
    """The broker's answer to EXTERNAL (an empty authorization identity, as clients send)
    over AMQPS with `context`'s certificate: the reply code pika does not show."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        sock = context.wrap_socket(raw, server_hostname="localhost")
        sock.sendall(PROTOCOL_HEADER)
        start, rest = next_frame(sock, b"")
        assert isinstance(start, commands.Connection.Start)
        assert "EXTERNAL" in str(start.mechanisms).split()
        answer = commands.Connection.StartOk(
            client_properties={}, mechanism="EXTERNAL", response="", locale="en_US"
        )
        sock.sendall(frame.marshal(answer, 0))
        close, _ = next_frame(sock, rest)
    assert isinstance(close, commands.Connection.Close)
    return close


def test_the_operator_puts_the_downstreams_cas_beside_the_login_bundle_never_in_it() -> None:
    spec = upstream_spec()
    args = dict(a.removeprefix("--").split("=", 1) for a in operator_tls_args(spec))
    # The one bundle whose certificates log in is the applications' (spec.tls.clientCertificates).
    assert args["tls-ca"] == f"{CLIENT_CA_DIR}/ca.crt"
    assert args["tls-federation-ca"] == f"{federation.DOWNSTREAM_CA_DIR}/ca.crt"
    assert args["tls-cert-login"] == "common_name"
    assert args["tls-client-certs"] == "optional"
    pod = build_pod(CLUSTER, spec, "primary")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["client-ca"]["configMap"]["name"] == "apps-ca"
    assert volumes[federation.DOWNSTREAM_CA_VOLUME]["configMap"]["name"] == (
        "central-federation-downstream-ca"
    )
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[federation.DOWNSTREAM_CA_VOLUME] == federation.DOWNSTREAM_CA_DIR
    # The pair's replication CA (the brokers' own certificates) has a listener and a flag
    # of its own: no CA but these two bundles reaches AMQPS.
    paired = build_pod(CLUSTER, spec, "primary", peer_tls="Required")["spec"]["containers"][0]
    cas = {a.split("=")[0]: a.split("=")[1] for a in paired["args"] if "-ca=" in a}
    assert cas == {
        "--tls-ca": f"{CLIENT_CA_DIR}/ca.crt",
        "--tls-federation-ca": f"{federation.DOWNSTREAM_CA_DIR}/ca.crt",
        "--replication-tls-ca": f"{PEER_TLS_DIR}/ca.crt",
    }
    # And the broker's own parser takes them as they are.
    settings = parse_args([f"--{k}={v}" for k, v in args.items()] + ["--tls-cert=c", "--tls-key=k"])
    assert settings.tls_federation_ca is not None and settings.tls_cert_login == "common_name"


def test_a_downstreams_ca_cannot_log_in_as_admin_but_the_applications_ca_still_does(
    tmp_path: Path, ca: TestCA, apps: TestCA, downstream: TestCA
) -> None:
    # A second downstream CA that spells the applications' CA's name: a name is no key.
    impostor = TestCA(tmp_path / "impostor-pki", name="applications CA")
    bundle = tmp_path / "downstreams.crt"
    bundle.write_text(downstream.cert.read_text() + impostor.cert.read_text())
    started = upstream_broker(tmp_path, ca, apps, bundle)
    with started.process.start():
        # The applications' CA: the certificate's name is the login, as before.
        conn = pika.BlockingConnection(external(started, ca, issue(apps, "billing")))
        conn.close()
        # A downstream's CA signing CN=admin: refused, 403 with the reason.
        minted = issue(downstream, "admin")
        close = external_close(started.port, client_context(ca, minted))
        assert close.reply_code == 403, close
        assert "not a login CA" in close.reply_text
        assert "CN=downstream site CA" in close.reply_text
        assert "not a login CA" in refusal(external(started, ca, minted))
        assert "not a login CA" in refusal(external(started, ca, keyed(impostor, "admin")))
        metrics = started.process.admin.metrics()
        assert "twinmq_auth_failures_total 3.0" in metrics
        # The handshake still takes the downstream's certificate: its password logs in.
        params = tls_params(started, client_context(ca, minted))
        params.credentials = pika.PlainCredentials("admin", ADMIN_PASSWORD)
        pika.BlockingConnection(params).close()


def test_a_downstreams_federation_link_still_runs_with_its_certificate_and_password(
    tmp_path: Path, ca: TestCA, apps: TestCA, downstream: TestCA
) -> None:
    started = upstream_broker(tmp_path / "central", ca, apps, downstream.cert)
    upstream = started.process
    # The upstream is the central site (the tests' publisher logs in as guest, loopback).
    upstream.extra_args += ["--server-id", "central"]
    link_cert: Leaf = downstream.issue("remote-federation", client=True)
    config = tmp_path / "remote.json"
    config.write_text(json.dumps({
        "upstreams": {"central": {
            "uri": f"amqps://{LINK_USER}@127.0.0.1:{started.port}/",
            "password-env": PASSWORD_ENV,
            "tls-ca": str(ca.cert), "tls-cert": str(link_cert.cert),
            "tls-key": str(link_cert.key)}},
        "exchanges": [{"exchange": "market", "upstream": "central", "type": "topic"}],
    }))  # fmt: skip
    remote = site(tmp_path, "remote", federation=config, port=free_port())
    remote.env[PASSWORD_ENV] = "link-secret"
    with upstream.start(), remote.start():
        wait_running(remote, "market")
        bind_queue(remote, "watch", "market", "stock.#")

        def delivered() -> bool:
            publish_confirmed(upstream, "market", [("stock.a", b"over amqps")])
            return queue_depth(remote, "watch") >= 1

        wait_for("a message over the downstream's amqps link", delivered, 60)
        assert links(remote)["market"]["upstream_server_id"] == "central"


def test_a_replaced_downstream_bundle_is_used_at_once_and_still_logs_in_no_one(
    tmp_path: Path, ca: TestCA, apps: TestCA, downstream: TestCA
) -> None:
    """The kubelet updates the operator's copy (a downstream joined, another left): new
    handshakes take the new CAs without a restart, and they are no login CAs either."""
    volume = BundleVolume(tmp_path / "downstream-ca")
    volume.write(downstream.cert.read_text())
    started = upstream_broker(tmp_path, ca, apps, volume)
    joined = TestCA(tmp_path / "joined-pki", name="joined site CA")
    newcomer = issue(joined, "admin")
    with started.process.start():
        assert not connects(started, ca, newcomer)
        volume.write(joined.cert.read_text())  # the old downstream's CA taken out
        wait_for("the joined downstream's certificate verified",
                 lambda: connects(started, ca, newcomer))  # fmt: skip
        assert not connects(started, ca, issue(downstream, "late"))
        assert "not a login CA" in refusal(external(started, ca, newcomer))
        pika.BlockingConnection(external(started, ca, issue(apps, "billing"))).close()


def test_without_a_federation_bundle_every_ca_of_tls_ca_logs_in_as_before(
    tmp_path: Path, ca: TestCA, apps: TestCA, downstream: TestCA
) -> None:
    """Backward compatible: a broker given one `--tls-ca` (a federation file's link that
    logs in with its certificate needs its CA there) logs in every CA of it; keeping a
    downstream's CA out of the logins is what `--tls-federation-ca` is for."""
    bundle = tmp_path / "bundle.crt"
    bundle.write_text(apps.cert.read_text() + downstream.cert.read_text())
    started: TlsBroker = tls_broker(
        tmp_path, ca.issue("server"), f"--tls-ca={bundle}", "--tls-client-certs=optional",
        "--tls-cert-login=common_name", f"--users-file={users_file(tmp_path / 'users.json')}",
    )  # fmt: skip
    with started.process.start():
        pika.BlockingConnection(external(started, ca, issue(downstream, "billing"))).close()


def test_a_federation_bundle_without_client_certificates_is_a_start_up_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="--tls-federation-ca needs client certificates"):
        parse_args(["--tls-cert=c", "--tls-key=k", "--tls-federation-ca=f"])
    settings = parse_args(["--tls-cert=c", "--tls-key=k", "--tls-ca=a", "--tls-federation-ca=f"])
    assert settings.effective_tls_client_certs == "required"
    # The settings file (and the environment, TWINMQ_TLS_FEDERATION_CA) give it as well.
    config = tmp_path / "broker.json"
    given = {"tls_cert": "c", "tls_key": "k", "tls_ca": "a", "tls_federation_ca": "f"}
    config.write_text(json.dumps(given))
    monkeypatch.setenv(names.CONFIG_ENV, str(config))
    assert parse_args([]).tls_federation_ca == Path("f")
