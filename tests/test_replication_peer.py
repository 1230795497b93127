"""The replication link bound to the pair's own peer (`--peer`, issue 16): real broker
processes on loopback, a foreign broker of the attacker's holding the pair's replication
token (the worst case: only the peer binding stands in its way), a throw-away CA.

The pair fixtures run hardened (`testing/pair.py`: each broker's `--peer` is the other,
here the link proxy standing in for its address); a broker without `--peer` shows the
unhardened mode, today's, so the refusals below are the flag's doing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pika
import pika.exceptions
import pytest
from pydantic import ValidationError

from twinmq.broker.admin_client import AdminError, SyncAdminClient, metric_samples
from twinmq.broker.api import NOT_THE_PEER, PEER_UNRESOLVED
from twinmq.broker.names import ACTIVE, ADMIN_TOKEN_ENV, PASSIVE, REPLICATION_TOKEN_ENV, setting_env
from twinmq.broker.replication.peer import Peer, PeerUnresolved
from twinmq.broker.settings import BrokerSettings
from twinmq.operator import certs
from twinmq.operator.builders import ClusterRef
from twinmq.testing.certs import TestCA
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, post_role, status
from twinmq.testing.waiting import wait_for

ADMIN_TOKEN = "peer-test-admin-token"
ROLE_REFUSED = 'twinmq_role_refused_total{reason="peer"}'
PEER_REFUSED = 'twinmq_replication_refused_total{reason="peer"}'
CERTIFICATE_REFUSED = 'twinmq_replication_refused_total{reason="certificate"}'


def samples(broker: BrokerProcess) -> dict[str, float]:
    return metric_samples(broker.admin.metrics(timeout=5))


def log_of(broker: BrokerProcess) -> str:
    assert broker.log_path is not None
    return broker.log_path.read_text()


def link_up(broker: BrokerProcess) -> bool:
    found = status(broker)
    return found is not None and bool(found["replication"]["link_connected"])


def started_passive(
    folder: Path, name: str, peer: str, replicate_from: BrokerProcess
) -> BrokerProcess:
    """A broker started passive with `--peer peer`, told to replicate from another."""
    broker = BrokerProcess(
        folder,
        name=name,
        env={REPLICATION_TOKEN_ENV: Pair.TOKEN, setting_env("peer"): peer},
        extra_args=["--role", PASSIVE, "--replicate-from", replicate_from.replication_address],
    )
    broker.start()
    return broker


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    hardened = Pair(tmp_path_factory.mktemp("pair"))
    for broker in hardened.brokers.values():
        broker.env[ADMIN_TOKEN_ENV] = ADMIN_TOKEN
    with hardened as started:
        yield started


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """The attacker's broker: active, with the pair's replication token."""
    broker = BrokerProcess(
        tmp_path_factory.mktemp("foreign"), name="mallory", env={REPLICATION_TOKEN_ENV: Pair.TOKEN}
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def test_a_replicate_from_that_is_not_the_peer_is_refused_and_the_passive_keeps_its_link(
    pair: Pair, foreign: BrokerProcess
) -> None:
    before = samples(pair.passive).get(ROLE_REFUSED, 0.0)
    code, body = post_role(pair.passive, PASSIVE, pair.epoch, foreign.replication_address)
    assert code == 403 and body["error"] == NOT_THE_PEER, body
    assert f"{foreign.replication_address} is not the peer {pair.link.address}" in body["detail"]
    assert samples(pair.passive)[ROLE_REFUSED] == before + 1
    assert "POST /role from 127.0.0.1 refused" in log_of(pair.passive)
    # Refused before anything changed: the passive still replicates from its peer...
    passive = status(pair.passive)
    assert passive is not None and passive["replication"]["peer"] == pair.link.address
    pair.wait_healthy(30)
    # ...and never dialled the foreign broker.
    assert not link_up(foreign)
    assert "replication link from" not in log_of(foreign)


def test_without_peer_a_passive_replicates_from_any_address_as_before(
    tmp_path: Path, foreign: BrokerProcess
) -> None:
    """The unhardened mode: what the refusal above prevents (the foreign broker is a real
    target a passive attaches to)."""
    broker = BrokerProcess(tmp_path, name="loose", env={REPLICATION_TOKEN_ENV: Pair.TOKEN})
    broker.start()
    try:
        code, body = post_role(broker, PASSIVE, 0, foreign.replication_address)
        assert code == 200 and body["role"] == PASSIVE, body
        wait_for("the foreign broker has a passive", lambda: link_up(foreign), 30)
    finally:
        broker.stop()
    wait_for("the foreign broker's passive gone", lambda: not link_up(foreign), 30)


def test_a_role_change_while_the_peer_does_not_resolve_is_deferred_with_503_not_refused(
    tmp_path: Path, foreign: BrokerProcess
) -> None:
    """A restarting peer pod has no DNS record for a moment: the broker answers 503 (the
    operator retries at its next pass), counts no refusal, and dials nothing meanwhile."""
    broker = BrokerProcess(
        tmp_path,
        name="unresolved",
        env={REPLICATION_TOKEN_ENV: Pair.TOKEN, setting_env("peer"): "b.peer.invalid"},
    )
    broker.start()
    try:
        code, body = post_role(broker, PASSIVE, 0, foreign.replication_address)
        assert code == 503 and body["error"] == PEER_UNRESOLVED, body
        assert "b.peer.invalid does not resolve" in body["detail"]
        assert samples(broker).get(ROLE_REFUSED, 0.0) == 0
        found = status(broker)
        assert found is not None and found["role"] != PASSIVE
        assert not link_up(foreign)
    finally:
        broker.stop()


def test_a_passive_whose_peer_does_not_resolve_waits_without_counting_a_refusal(
    tmp_path: Path, foreign: BrokerProcess
) -> None:
    broker = started_passive(tmp_path, "unresolved-passive", "b.peer.invalid", foreign)
    try:
        wait_for("the wait logged", lambda: "does not resolve" in log_of(broker), 30)
        assert f"not replicating from {foreign.replication_address} yet" in log_of(broker)
        assert samples(broker).get(PEER_REFUSED, 0.0) == 0
        assert not link_up(foreign)
    finally:
        broker.stop()


def test_a_passive_started_with_a_replicate_from_that_is_not_its_peer_never_dials_it(
    tmp_path: Path, foreign: BrokerProcess
) -> None:
    broker = started_passive(tmp_path, "started-astray", "127.0.0.1:1", foreign)
    try:
        wait_for("the refusal", lambda: samples(broker).get(PEER_REFUSED, 0.0) >= 1, 30)
        assert f"not replicating from {foreign.replication_address}" in log_of(broker)
        assert not link_up(broker) and not link_up(foreign)
    finally:
        broker.stop()


@pytest.mark.parametrize(
    ("peer", "address", "accepted"),
    [
        ("localhost:5673", "localhost:5673", True),
        ("LocalHost.:5673", "localhost:5673", True),
        ("localhost:5673", "127.0.0.1:5673", True),  # an address the peer resolves to
        ("localhost", "127.0.0.1:6000", True),  # no port in --peer: any port
        ("localhost:5673", "127.0.0.1:5674", False),
        ("localhost:5673", "127.0.0.2:5673", False),
        ("localhost:5673", "localhost.example:5673", False),
        ("10.0.0.7:5673", "10.0.0.8:5673", False),
    ],
)
def test_the_peer_is_its_host_or_an_address_it_resolves_to_and_its_port(
    peer: str, address: str, accepted: bool
) -> None:
    refusal = asyncio.run(Peer.parse(peer).address_refusal(address))
    assert (refusal is None) == accepted, refusal


def test_a_peer_name_that_does_not_resolve_defers_the_check_and_refuses_nothing() -> None:
    """A restarting pod's DNS record is gone for a moment: the address can be judged
    neither way, which the admin API answers with 503 (retry), not 403 (refused)."""
    with pytest.raises(PeerUnresolved, match="does not resolve"):
        asyncio.run(Peer.parse("b.peer.invalid:5673").address_refusal("10.0.0.8:5673"))


def test_the_replication_token_opens_neither_the_admin_api_nor_amqp(pair: Pair) -> None:
    """The link's identity is its own: the replication token is no admin bearer (not even
    to read) and no AMQP password."""
    with SyncAdminClient(pair.passive.admin_url, Pair.TOKEN) as admin:
        calls: list[Callable[[], object]] = [
            admin.status,
            lambda: admin.set_role(ACTIVE, pair.epoch + 1),
        ]
        for call in calls:
            with pytest.raises(AdminError) as refused:
                call()
            assert refused.value.status == 401
    for user in ("guest", "replication", pair.active.name):
        credentials = pika.PlainCredentials(user, Pair.TOKEN)
        params = pika.ConnectionParameters(
            "127.0.0.1", pair.active.port, credentials=credentials, connection_attempts=1
        )
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            pika.BlockingConnection(params)
    pair.wait_healthy(30)


def test_hardened_mode_needs_a_replication_token_of_its_own() -> None:
    with pytest.raises(ValidationError, match="--peer needs --replication-token"):
        BrokerSettings(peer="b:5673", admin_token="x")
    with pytest.raises(ValidationError, match="must differ from --admin-token"):
        BrokerSettings(peer="b:5673", admin_token="same", replication_token="same")
    with pytest.raises(ValidationError, match="must differ from --admin-read-token"):
        BrokerSettings(peer="b:5673", admin_read_token="same", replication_token="same")
    assert BrokerSettings(peer="b:5673", replication_token="own").replication_peer == Peer(
        "b", 5673
    )


def test_a_certificate_of_the_pairs_ca_that_does_not_name_the_peer_is_refused_by_the_active(
    tmp_path: Path,
) -> None:
    """mallory holds a certificate of the pair's own CA naming itself, both uses, and the
    replication token: everything but being the peer. The active (`--peer` b's address,
    b's certificate name `b`) refuses it, and its passive b stays attached."""
    ca = TestCA(tmp_path / "ca")
    leaves = {name: ca.issue(name, peer=True) for name in ("a", "b", "mallory")}

    def tls_env(name: str) -> dict[str, str]:
        return {
            setting_env("replication_tls_cert"): str(leaves[name].cert),
            setting_env("replication_tls_key"): str(leaves[name].key),
            setting_env("replication_tls_ca"): str(ca.cert),
        }

    tls_pair = Pair(tmp_path / "pair", link=False)
    for name, broker in tls_pair.brokers.items():
        broker.env.update(tls_env(name))
        # As the operator's pods: the peer's address, and the name its certificate carries.
        other = "b" if name == "a" else "a"
        broker.env[setting_env("replication_tls_server_name")] = other
    mallory = BrokerProcess(
        tmp_path / "mallory",
        name="mallory",
        env={REPLICATION_TOKEN_ENV: Pair.TOKEN, **tls_env("mallory")},
        extra_args=["--role", PASSIVE, "--replicate-from", tls_pair.active.replication_address],
    )
    with tls_pair:
        mallory.start()
        try:
            wait_for(
                "the active's refusal",
                lambda: samples(tls_pair.active).get(PEER_REFUSED, 0.0) >= 1,
                30,
            )
            assert "('mallory') is not the peer" in log_of(tls_pair.active)
            assert not link_up(mallory)
            active = status(tls_pair.active)
            assert active is not None and active["replication"]["link_tls"]
            tls_pair.wait_healthy(30)
        finally:
            mallory.stop()


@pytest.mark.parametrize("localhost_named", [False, True])
def test_the_passive_checks_the_actives_certificate_for_the_peers_name_not_the_address_it_dials(
    tmp_path: Path, localhost_named: bool
) -> None:
    """b's peer is `localhost`; it dials a at 127.0.0.1, where `localhost` resolves. a's
    certificate (the pair's CA, both uses) is valid for 127.0.0.1, all a passive checked
    without a server name: b pairs with it only if it also names `localhost`."""
    now = datetime.now(UTC)
    ca = certs.new_ca(ClusterRef(namespace="ns", name="pair", uid="u-1"), now)
    a_names = ["a", "localhost"] if localhost_named else ["a"]
    owns = {
        "a": certs.issue_server(ca, a_names, now, 3600, client=True, addresses=["127.0.0.1"]),
        "b": certs.issue_server(ca, ["b"], now, 3600, client=True, addresses=["127.0.0.1"]),
    }
    tls_pair = Pair(tmp_path / "pair", link=False)
    for name, broker in tls_pair.brokers.items():
        folder = tmp_path / f"{name}-files"
        folder.mkdir()
        for file, text in (("tls.crt", owns[name].cert), ("tls.key", owns[name].key),
                           ("ca.crt", ca.cert)):  # fmt: skip
            (folder / file).write_text(text)
        broker.env.update({
            setting_env("replication_tls_cert"): str(folder / "tls.crt"),
            setting_env("replication_tls_key"): str(folder / "tls.key"),
            setting_env("replication_tls_ca"): str(folder / "ca.crt"),
        })  # fmt: skip
    tls_pair.passive.env[setting_env("peer")] = f"localhost:{tls_pair.active.replication_port}"
    if localhost_named:
        with tls_pair:
            passive = status(tls_pair.passive)
            assert passive is not None and passive["replication"]["link_tls"]
        return
    try:
        for broker, role in ((tls_pair.active, ACTIVE), (tls_pair.passive, PASSIVE)):
            broker.extra_args = tls_pair.args(role)
            broker.start()
        wait_for(
            "the passive's refusal",
            lambda: samples(tls_pair.passive).get(CERTIFICATE_REFUSED, 0.0) >= 1,
            30,
        )
        assert "certificate verify failed" in log_of(tls_pair.passive)
        assert not link_up(tls_pair.passive)
    finally:
        tls_pair.stop()
