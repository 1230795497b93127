"""Mutual TLS on the replication link (issue 16): real pairs on loopback, a throw-away CA.

Each broker presents a certificate the CA signed that names it; the active accepts only a
passive whose certificate names the broker its handshake claims to be, the passive only
an active whose certificate covers the address it dialled and the name it claims. The
token's proof still runs inside TLS: the certificate binds the identity, the token the
pair.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pika
import pytest
from replpeer import RawLink

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.names import setting_env
from twinmq.broker.settings import parse_args
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

QUEUE = "tls-replicated"
REFUSED = 'twinmq_replication_refused_total{reason="certificate"}'


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


def tls_pair(root: Path, ca_cert: Path, leaves: dict[str, Leaf], *, link: bool = True) -> Pair:
    """A pair (a active, b passive, through the proxy with `link`) whose brokers use
    `leaves`."""
    pair = Pair(root, replication_timeout=1.0, link=link)
    for name, broker in pair.brokers.items():
        broker.env[setting_env("replication_tls_cert")] = str(leaves[name].cert)
        broker.env[setting_env("replication_tls_key")] = str(leaves[name].key)
        broker.env[setting_env("replication_tls_ca")] = str(ca_cert)
    return pair


@contextmanager
def unmatched(pair: Pair) -> Iterator[Pair]:
    """Both brokers started, without waiting for a pair that will never form; stopped after."""
    try:
        for broker, role in ((pair.active, "active"), (pair.passive, "passive")):
            broker.extra_args = pair.args(role)
            broker.start()
        yield pair
    finally:
        pair.stop()


def refused(broker: BrokerProcess) -> float:
    return metric_samples(broker.admin.metrics(timeout=5)).get(REFUSED, 0.0)


def log_of(broker: BrokerProcess) -> str:
    assert broker.log_path is not None
    return broker.log_path.read_text()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, ca: TestCA) -> Iterator[Pair]:
    leaves = {name: ca.issue(name, peer=True) for name in ("a", "b")}
    with tls_pair(tmp_path_factory.mktemp("pair"), ca.cert, leaves) as started:
        yield started


def test_a_pair_replicates_over_mutual_tls_and_fails_over_with_every_confirmed_message(
    pair: Pair,
) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    try:
        channel = connection.channel()
        channel.queue_declare(QUEUE, durable=True)
        channel.confirm_delivery()
        for i in range(200):
            channel.basic_publish("", QUEUE, str(i).encode(), pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()
    assert pair.failover(ready_timeout=30), "the passive was not ready"
    pair.wait_healthy(60)
    connection = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    try:
        declared = connection.channel().queue_declare(QUEUE, durable=True, passive=True)
        assert declared.method.message_count == 200
    finally:
        connection.close()
    assert refused(pair.active) == 0 and refused(pair.passive) == 0


def test_the_replication_port_speaks_no_plaintext(pair: Pair) -> None:
    """A plain-text peer gets no challenge: its bytes fail the TLS handshake and the
    active closes the connection."""
    host, _, port = pair.active.replication_address.rpartition(":")
    with RawLink.connect(host, int(port)) as link:
        link.send_raw(b"not a TLS client hello\r\n" * 4)
        assert link.recv(timeout=10) is None
    pair.wait_healthy(30)


def test_a_passive_with_a_certificate_from_another_ca_never_attaches(
    tmp_path: Path, ca: TestCA
) -> None:
    stranger = TestCA(tmp_path / "other-ca", name="another CA")
    leaves = {"a": ca.issue("a", peer=True), "b": stranger.issue("b", peer=True)}
    pair = tls_pair(tmp_path / "pair", ca.cert, leaves, link=False)
    with unmatched(pair):
        wait_for("the active's refusal", lambda: refused(pair.active) >= 1, 30)
        assert "failed the TLS handshake" in log_of(pair.active)
        active = status(pair.active)
        assert active is not None and not active["replication"]["link_connected"]


def test_a_peer_whose_certificate_names_another_broker_is_refused(
    tmp_path: Path, ca: TestCA
) -> None:
    """b holds a valid certificate of the CA, but issued to `mallory`: the active refuses
    it at the handshake, though its token proof holds."""
    leaves = {"a": ca.issue("a", peer=True), "b": ca.issue("mallory", peer=True)}
    pair = tls_pair(tmp_path / "pair", ca.cert, leaves, link=False)
    with unmatched(pair):
        wait_for("the active's refusal", lambda: refused(pair.active) >= 1, 30)
        assert "claims to be 'b'" in log_of(pair.active)
        passive = status(pair.passive)
        assert passive is not None and not passive["replication"]["ready"]


def test_replication_tls_needs_all_three_files() -> None:
    with pytest.raises(ValueError, match="go together"):
        parse_args(["--replication-tls-cert", "/x.crt", "--replication-tls-key", "/x.key"])


MODES: dict[str, str | None] = {
    "plaintext": None,
    "plain-listener": "plain-listener",
    "tls-listener": "tls-listener",
    "required": "required",
}
# A rolling update runs each step beside the one before (either broker may be the
# updated one, and either the active): every adjacent pair must pair.
NEIGHBOURS = [
    ("plaintext", "plain-listener"),
    ("plain-listener", "plaintext"),
    ("plain-listener", "tls-listener"),
    ("tls-listener", "plain-listener"),
    ("tls-listener", "required"),
    ("required", "tls-listener"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("active_mode", "passive_mode"), NEIGHBOURS)
def test_each_step_of_the_move_to_mutual_tls_pairs_with_the_step_before_and_after(
    tmp_path: Path, ca: TestCA, active_mode: str, passive_mode: str
) -> None:
    """The operator moves a running pair to mutual TLS one rolling update at a time
    (operator/peertls.py): each step's broker pairs with the one before and after it, so
    the passive is in sync (and the switchover of the rollout allowed) at every moment.
    The active's listener decides whether the link is TLS."""
    leaves = {name: ca.issue(name, peer=True) for name in ("a", "b")}
    pair = Pair(tmp_path / "pair", replication_timeout=1.0, link=False)
    for name, mode in (("a", MODES[active_mode]), ("b", MODES[passive_mode])):
        broker = pair.brokers[name]
        if mode is None:
            continue
        broker.env[setting_env("replication_tls_cert")] = str(leaves[name].cert)
        broker.env[setting_env("replication_tls_key")] = str(leaves[name].key)
        broker.env[setting_env("replication_tls_ca")] = str(ca.cert)
        broker.env[setting_env("replication_tls_mode")] = mode
    with pair:
        passive = status(pair.passive)
        assert passive is not None and passive["replication"]["ready"]
        tls = active_mode in ("tls-listener", "required")
        assert passive["replication"]["link_tls"] is tls
        active = status(pair.active)
        assert active is not None and active["replication"]["link_tls"] is tls
        assert refused(pair.active) == 0
