"""A federation link that logs in with its client certificate (`?auth_mechanism=external`,
RabbitMQ's URI parameter) to an upstream with `--tls-cert-login`: no password anywhere,
the link's user is the one its certificate names. Real brokers on loopback, a CA a site."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from federationsites import bind_queue, links, publish_confirmed, queue_depth, site, wait_running
from pydantic import ValidationError

from twinmq.broker.federation.config import Upstream
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.waiting import wait_for


@pytest.fixture
def central_ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "central-ca", name="central site CA")


@pytest.fixture
def remote_ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "remote-ca", name="remote site CA")


def central(tmp: Path, ca: TestCA, clients: TestCA) -> tuple[BrokerProcess, int]:
    """The upstream: AMQPS asking for a certificate of the `clients` CA, certificate login
    by common name; its users `guest` (the tests' publisher, loopback) and
    `remote-federation`, who has no password: it can log in with its certificate only."""
    users = tmp / "central-users.json"
    users.write_text(json.dumps({"users": [{"name": "guest", "password": "guest"},
                                           {"name": "remote-federation",
                                            "tags": ["federation"]}]}))  # fmt: skip
    server = ca.issue("central-server")
    port = free_port()
    broker = site(tmp, "central")
    broker.extra_args += ["--tls-cert", str(server.cert), "--tls-key", str(server.key),
                          "--tls-ca", str(clients.cert), "--tls-port", str(port),
                          "--tls-client-certs", "optional", "--tls-cert-login", "common_name",
                          "--users-file", str(users)]  # fmt: skip
    return broker, port


def remote(tmp: Path, port: int, ca: TestCA, client: Leaf) -> BrokerProcess:
    """The downstream: federates central's `market` over amqps, logging in with EXTERNAL."""
    tmp.mkdir(exist_ok=True)
    upstream = {
        "uri": f"amqps://127.0.0.1:{port}/?auth_mechanism=external",
        "tls-ca": str(ca.cert),
        "tls-cert": str(client.cert),
        "tls-key": str(client.key),
    }
    config = tmp / "remote.json"
    config.write_text(json.dumps({
        "upstreams": {"central": upstream},
        "exchanges": [{"exchange": "market", "upstream": "central", "type": "topic"}],
    }))  # fmt: skip
    return site(tmp, "remote", federation=config)


def test_a_link_logs_in_with_its_certificate_as_the_user_it_names(
    tmp_path: Path, central_ca: TestCA, remote_ca: TestCA
) -> None:
    upstream, port = central(tmp_path, central_ca, remote_ca)
    named = remote_ca.issue("remote-federation", client=True)
    unknown = remote_ca.issue("other-site", client=True)
    with upstream.start():
        with remote(tmp_path / "named", port, central_ca, named).start() as downstream:
            wait_running(downstream, "market")
            bind_queue(downstream, "watch", "market", "stock.#")

            def delivered() -> bool:
                publish_confirmed(upstream, "market", [("stock.a", b"by certificate")])
                return queue_depth(downstream, "watch") >= 1

            wait_for("a message over the certificate-login link", delivered, 60)
        # A certificate naming no user of the upstream: refused, and the link says why.
        with remote(tmp_path / "unknown", port, central_ca, unknown).start() as downstream:
            wait_for(
                "the link's refusal",
                lambda: "no user 'other-site'" in str(links(downstream)["market"]["error"] or ""),
                60,
            )
            assert links(downstream)["market"]["state"] != "running"


@pytest.mark.parametrize(
    ("upstream", "reason"),
    [
        ({"uri": "amqp://h/?auth_mechanism=external"}, "needs amqps:// and tls-cert"),
        ({"uri": "amqps://h/?auth_mechanism=external"}, "needs amqps:// and tls-cert"),
        ({"uri": "amqps://h/?auth_mechanism=gssapi"}, "plain or external"),
        ({"uri": "amqps://bob@h/?auth_mechanism=external", "tls-cert": "c", "tls-key": "k"},
         "the uri names none"),
        ({"uri": "amqps://h/?auth_mechanism=external", "tls-cert": "c", "tls-key": "k",
          "password-env": "P"}, "no password-env"),
    ],
)  # fmt: skip
def test_an_external_upstream_needs_amqps_a_certificate_and_no_user_or_password(
    upstream: dict[str, str], reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        Upstream.model_validate(upstream)
    good = {"uri": "amqps://h/?auth_mechanism=external", "tls-cert": "c", "tls-key": "k"}
    assert Upstream.model_validate(good).auth_mechanism == "EXTERNAL"
