"""A federation link over amqps to an upstream in another site (issue 16): the upstream's
certificate verified against a CA the federation file names (not the system's), and a
client certificate when the upstream asks for one. Real brokers on loopback, a CA per site.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from federationsites import (
    PASSWORD_ENV,
    bind_queue,
    links,
    publish_confirmed,
    queue_depth,
    site,
    wait_running,
)

from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.waiting import wait_for


@pytest.fixture(scope="module")
def central_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("central-ca"), name="central site CA")


@pytest.fixture(scope="module")
def remote_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("remote-ca"), name="remote site CA")


def central(
    tmp: Path, ca: TestCA, clients: TestCA, client_certs: str = "required"
) -> tuple[BrokerProcess, int]:
    """The upstream: AMQPS with its own CA's certificate, asking for a client certificate
    of the `clients` CA (the downstream site's), `required` or `optional`."""
    server = ca.issue("central-server")
    port = free_port()
    broker = site(tmp, "central")
    broker.extra_args += ["--tls-cert", str(server.cert), "--tls-key", str(server.key),
                          "--tls-ca", str(clients.cert), "--tls-port", str(port),
                          "--tls-client-certs", client_certs]  # fmt: skip
    return broker, port


def remote(tmp: Path, port: int, **tls: Any) -> BrokerProcess:
    """The downstream, federating central's `market` over amqps with `tls` settings."""
    upstream = {"uri": f"amqps://guest@127.0.0.1:{port}/", "password-env": PASSWORD_ENV}
    upstream.update({k.replace("_", "-"): str(v) for k, v in tls.items()})
    config = tmp / "remote.json"
    config.write_text(json.dumps({
        "upstreams": {"central": upstream},
        "exchanges": [{"exchange": "market", "upstream": "central", "type": "topic"}],
    }))  # fmt: skip
    return site(tmp, "remote", federation=config)


def link_error(broker: BrokerProcess) -> str:
    return str((links(broker).get("market") or {}).get("error") or "")


def test_a_link_runs_over_amqps_verified_by_the_named_ca_with_a_client_certificate(
    tmp_path: Path, central_ca: TestCA, remote_ca: TestCA
) -> None:
    upstream, port = central(tmp_path, central_ca, remote_ca)
    client: Leaf = remote_ca.issue("remote-federation", client=True)
    with upstream.start(), remote(tmp_path, port, tls_ca=central_ca.cert, tls_cert=client.cert,
                                  tls_key=client.key).start() as downstream:  # fmt: skip
        wait_running(downstream, "market")
        bind_queue(downstream, "watch", "market", "stock.#")
        # Published until the binding reached the upstream and a message came through.
        wait_for("a message over the amqps link", lambda: _published(upstream, downstream), 60)
        assert links(downstream)["market"]["upstream_server_id"] == "central"


def _published(upstream: BrokerProcess, downstream: BrokerProcess) -> bool:
    publish_confirmed(upstream, "market", [("stock.a", b"over amqps")])
    return queue_depth(downstream, "watch") >= 1


def test_an_upstream_whose_certificate_another_ca_signed_is_refused(
    tmp_path: Path, central_ca: TestCA, remote_ca: TestCA
) -> None:
    upstream, port = central(tmp_path, central_ca, remote_ca)
    client = remote_ca.issue("remote-federation", client=True)
    # The downstream trusts its own CA only: the upstream's certificate does not verify.
    with upstream.start(), remote(tmp_path, port, tls_ca=remote_ca.cert, tls_cert=client.cert,
                                  tls_key=client.key).start() as downstream:  # fmt: skip
        wait_for("the link's verification error",
                 lambda: "CERTIFICATE_VERIFY_FAILED" in link_error(downstream), 60)  # fmt: skip
        assert links(downstream)["market"]["state"] != "running"


def test_a_downstream_without_the_client_certificate_the_upstream_asks_for_never_links(
    tmp_path: Path, central_ca: TestCA, remote_ca: TestCA
) -> None:
    upstream, port = central(tmp_path, central_ca, remote_ca)
    with upstream.start(), remote(tmp_path, port, tls_ca=central_ca.cert).start() as downstream:
        wait_for("the link's error", lambda: link_error(downstream) != "", 60)
        assert links(downstream)["market"]["state"] != "running"


def test_optional_client_certificates_let_a_trusted_one_or_none_link_never_a_stranger(
    tmp_path: Path, central_ca: TestCA, remote_ca: TestCA
) -> None:
    # What the operator sets on a BrokerCluster upstream: client certificates optional,
    # verified against the downstreams' CAs when presented.
    upstream, port = central(tmp_path, central_ca, remote_ca, "optional")
    client = remote_ca.issue("remote-federation", client=True)
    stranger = TestCA(tmp_path / "stranger-ca", name="stranger CA").issue("x", client=True)
    for name in ("trusted", "stranger", "none"):
        (tmp_path / name).mkdir()
    with upstream.start():
        with remote(tmp_path / "trusted", port, tls_ca=central_ca.cert, tls_cert=client.cert,
                    tls_key=client.key).start() as downstream:  # fmt: skip
            wait_running(downstream, "market")
        with remote(tmp_path / "stranger", port, tls_ca=central_ca.cert, tls_cert=stranger.cert,
                    tls_key=stranger.key).start() as downstream:  # fmt: skip
            wait_for("the stranger's certificate refused", lambda: link_error(downstream) != "",
                     60)  # fmt: skip
            assert links(downstream)["market"]["state"] != "running"
        # No certificate at all: optional, the login is the password's.
        with remote(tmp_path / "none", port, tls_ca=central_ca.cert).start() as downstream:
            wait_running(downstream, "market")
