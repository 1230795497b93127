"""Nothing unauthenticated changes a broker's state (issue 11, fault class 6).

A real pair (`jepsen.Pair`: `a` active, `b` passive through a proxy) and an
attacker on loopback with raw sockets: it talks to either broker's
replication listener directly, or takes the active's place for the passive
(the proxy retargeted to a `FakeListener`). After every attack both brokers
keep their persisted epoch and role, and the real pair still replicates and
confirms. The pair is shared by the module: each test leaves it as it found it.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from jepsen import queue_counts
from replpeer import FakeListener, RawLink, hello_for, welcome_for

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.epoch import epoch_jump_refusal
from twinmq.broker.journal import StoredMessage, encode_ops
from twinmq.broker.replication.handshake import new_nonce, transcript_proof, verify
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    Challenge,
    FrameDecoder,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    Welcome,
    encode,
    encode_batch,
)
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, post_role, status
from twinmq.testing.waiting import wait_for

TOKEN = Pair.TOKEN
ABSURD = 10**12
QUEUE = "auth-probe"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One pair for the module, with a 1 s handshake deadline."""
    started = Pair(tmp_path_factory.mktemp("pair"), replication_timeout=1.0)
    for broker in started.brokers.values():
        broker.env["TWINMQ_REPLICATION_HANDSHAKE_TIMEOUT"] = "1"
    with started:
        yield started


@pytest.fixture
def intact(pair: Pair) -> Iterator[Pair]:
    """The pair; afterwards, proof that the test's attack changed nothing."""
    pair.wait_healthy(15)
    before = {b.name: _state(b) for b in pair.brokers.values()}
    yield pair
    after = {b.name: _state(b) for b in pair.brokers.values()}
    assert after == before, "an attack changed a broker's epoch or role"
    pair.wait_healthy(15)
    _replicates_and_confirms(pair)


def _state(broker: BrokerProcess) -> tuple[str, int, int]:
    """(role, epoch in /status, epoch persisted in epoch.json)."""
    data = status(broker)
    assert data is not None, f"{broker.name} does not answer"
    persisted = json.loads((broker.data_dir / "epoch.json").read_text())["epoch"]
    return data["role"], data["epoch"], persisted


def _replicates_and_confirms(pair: Pair) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    try:
        channel = connection.channel()
        channel.queue_declare(QUEUE, durable=True)
        channel.confirm_delivery()  # basic_publish raises unless confirmed
        channel.basic_publish("", QUEUE, b"probe", pika.BasicProperties(delivery_mode=2))
        active = queue_counts(status(pair.active), QUEUE)
    finally:
        connection.close()
    # A confirm waits for the passive's disk: it holds the message already.
    assert active is not None and queue_counts(status(pair.passive), QUEUE) == active


def _log(broker: BrokerProcess) -> str:
    assert broker.log_path is not None
    return broker.log_path.read_text()


def _metric(broker: BrokerProcess, sample: str) -> float:
    return metric_samples(broker.admin.metrics(timeout=2)).get(sample, 0.0)


@pytest.fixture
def fake_active(pair: Pair) -> Iterator[FakeListener]:
    """The passive's link retargeted to a listener the test plays; restored afterwards."""
    with FakeListener() as fake:
        pair.link.retarget(fake.address)
        try:
            yield fake
        finally:
            pair.link.retarget(pair.active.replication_address)


# -- the handshake and the frame bound, sans-I/O ----------------------------------------


def _proof(**changes: object) -> str:
    fields: dict[str, object] = {
        "active": "a", "passive": "b", "active_nonce": "1" * 32, "passive_nonce": "2" * 32,
        "epoch": 1,
    }  # fmt: skip
    prover = changes.pop("prover", "passive")
    fields.update(changes)
    return transcript_proof(TOKEN, prover, **fields)  # type: ignore[arg-type]


def test_a_proof_binds_direction_names_nonces_and_epoch() -> None:
    base = _proof()
    variants = [
        _proof(prover="active"), _proof(active="x"), _proof(passive="x"),
        _proof(active_nonce="3" * 32), _proof(passive_nonce="3" * 32), _proof(epoch=2),
        # Moving a byte from one field to the next is another transcript.
        _proof(active="ab", passive=""),
    ]  # fmt: skip
    assert base not in variants and len(set(variants)) == len(variants)


def test_verify_refuses_reflection_no_token_and_a_wrong_proof() -> None:
    args = {"active": "a", "passive": "b", "active_nonce": "1" * 32, "passive_nonce": "2" * 32}
    good = transcript_proof(TOKEN, "passive", epoch=1, **args)
    assert verify(TOKEN, good, "passive", epoch=1, **args) is None
    assert verify(TOKEN, good, "active", epoch=1, **args) == "wrong proof"
    assert verify(TOKEN, good, "passive", epoch=2, **args) == "wrong proof"
    assert verify(None, good, "passive", epoch=1, **args) == "no replication token configured"
    same = {**args, "passive": "a"}
    assert "own name" in str(verify(TOKEN, good, "passive", epoch=1, **same))
    echoed = {**args, "passive_nonce": args["active_nonce"]}
    assert "echoed" in str(verify(TOKEN, good, "passive", epoch=1, **echoed))


def test_decoder_refuses_an_oversized_frame_from_its_header_until_lifted() -> None:
    decoder = FrameDecoder(MAX_HANDSHAKE_FRAME)
    big = encode(FrameType.SNAPSHOT, b"x" * (MAX_HANDSHAKE_FRAME + 1))
    decoder.push(big[:5])  # the header alone is enough to refuse it
    with pytest.raises(ProtocolError, match="out of range"):
        decoder.next()
    # Lifted (after authentication), the same frame passes, even already buffered.
    decoder = FrameDecoder(MAX_HANDSHAKE_FRAME)
    decoder.push(encode(FrameType.HELLO, b"{}") + big)
    assert decoder.next() == (FrameType.HELLO, b"{}")
    decoder.max_frame = MAX_FRAME
    assert decoder.next() == (FrameType.SNAPSHOT, big[5:])
    assert decoder.next() is None


def test_epoch_jump_bound() -> None:
    assert epoch_jump_refusal(5, 6, 1000) is None
    assert epoch_jump_refusal(5, 1005, 1000) is None
    assert epoch_jump_refusal(5, 3, 1000) is None  # lower: nothing to learn, nothing refused
    refusal = epoch_jump_refusal(5, ABSURD, 1000)
    assert refusal is not None and "max_epoch_jump 1000" in refusal


# -- unauthenticated frames to a listener ------------------------------------------------


@pytest.mark.parametrize("target", ["active", "passive"])
def test_forged_refuse_before_hello_changes_no_epoch_and_no_role(intact: Pair, target: str) -> None:
    broker = intact.active if target == "active" else intact.passive
    with RawLink.connect(broker.host, broker.replication_port) as link:
        link.expect(FrameType.CHALLENGE)
        link.send(FrameType.REFUSE, Refuse(reason="you are stale", epoch=ABSURD))
        link.closed_by_peer()
    assert "unauthenticated refusal" in _log(broker)


def test_hello_with_a_bad_proof_is_refused(intact: Pair) -> None:
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as link:
        challenge = Challenge.model_validate_json(link.expect(FrameType.CHALLENGE))
        forged = hello_for("not-the-token", challenge, "b", ABSURD)
        link.send(FrameType.HELLO, forged)
        assert link.closed_by_peer() == [FrameType.REFUSE]
    assert "claims to be 'b'): authentication failed: wrong proof" in _log(active)


def test_a_proof_for_another_challenge_is_refused(intact: Pair) -> None:
    """A real proof, relayed from another handshake: it answers that one only."""
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as first:
        old = Challenge.model_validate_json(first.expect(FrameType.CHALLENGE))
    relayed = hello_for(TOKEN, old, "b", 1)
    with RawLink.connect(active.host, active.replication_port) as link:
        link.expect(FrameType.CHALLENGE)
        link.send(FrameType.HELLO, relayed)
        assert link.closed_by_peer() == [FrameType.REFUSE]


def test_oversized_frame_before_authentication_is_refused_unread(intact: Pair) -> None:
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as link:
        link.expect(FrameType.CHALLENGE)
        # A HELLO announcing 100 MiB: the listener must not wait for (or buffer) it.
        link.send_raw(struct.pack(">IB", 100 * 1024 * 1024, FrameType.HELLO) + b"{")
        assert link.closed_by_peer() == []
    assert "out of range (limit 4096)" in _log(active)


def test_slow_handshake_is_closed_at_its_deadline(intact: Pair) -> None:
    """A peer that sends its HELLO a byte at a time never gets past the 1 s deadline."""
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as link:
        challenge = Challenge.model_validate_json(link.expect(FrameType.CHALLENGE))
        frame = encode(FrameType.HELLO, hello_for(TOKEN, challenge, "b", 1))
        closed = False
        for byte in frame:  # 0.1 s a byte: many seconds, far past the deadline
            try:
                link.send_raw(bytes([byte]))
                closed = link.recv(timeout=0.1) is None
            except TimeoutError:
                continue
            except OSError:  # reset by the active
                closed = True
            if closed:
                break
        assert closed, "the whole HELLO got through, byte by byte"
    assert "did not authenticate within 1.0s" in _log(active)


def test_connections_over_the_cap_are_closed_at_once(intact: Pair) -> None:
    active = intact.active
    links: list[RawLink] = []
    try:
        while len(links) < 8:
            link = RawLink.connect(active.host, active.replication_port)
            links.append(link)
            frame = link.recv()
            if frame is None:
                break  # closed at once, not even a CHALLENGE
            assert frame[0] is FrameType.CHALLENGE
        # The passive holds one of the 4 places the cap (the default) allows.
        assert len(links) - 1 == 3, f"{len(links) - 1} connections served before the cap"
        assert _metric(active, 'twinmq_replication_refused_total{reason="over-cap"}') >= 1
    finally:
        for link in links:
            link.close()
    assert "the cap (replication_max_connections)" in _log(active)
    # Closed connections free their places.
    wait_for("a new connection challenged", lambda: _challenged(active), 5)


def _challenged(broker: BrokerProcess) -> bool:
    with RawLink.connect(broker.host, broker.replication_port) as link:
        frame = link.recv()
        return frame is not None and frame[0] is FrameType.CHALLENGE


# -- a forged active, to the passive -----------------------------------------------------


def test_forged_active_cannot_change_the_passive(intact: Pair, fake_active: FakeListener) -> None:
    passive = intact.passive
    # A REFUSE instead of a WELCOME: unauthenticated, ignored.
    link, _ = fake_active.challenge()
    with link:
        link.expect(FrameType.HELLO)
        link.send(FrameType.REFUSE, Refuse(reason="stale", epoch=ABSURD))
        link.closed_by_peer()
    # A WELCOME with a made-up proof and epoch.
    link, _ = fake_active.challenge()
    with link:
        link.expect(FrameType.HELLO)
        link.send(FrameType.WELCOME, Welcome(epoch=ABSURD, proof="0" * 64))
        link.closed_by_peer()
    assert "failed authentication: wrong proof" in _log(passive)


def test_passive_proof_reflected_as_the_active_is_refused(
    intact: Pair, fake_active: FakeListener
) -> None:
    link, _ = fake_active.challenge()
    with link:
        hello = Hello.model_validate_json(link.expect(FrameType.HELLO))
        link.send(FrameType.WELCOME, Welcome(epoch=hello.epoch, proof=hello.proof))
        link.closed_by_peer()


def test_passive_does_not_answer_a_challenge_in_its_own_name(
    intact: Pair, fake_active: FakeListener
) -> None:
    """The passive's own listener's challenge, relayed to it: it proves nothing to itself."""
    passive = intact.passive
    with RawLink.connect(passive.host, passive.replication_port) as own:
        relayed = own.expect(FrameType.CHALLENGE)
        link = fake_active.accept()
        with link:
            link.send(FrameType.CHALLENGE, Challenge.model_validate_json(relayed))
            assert link.closed_by_peer() == []  # no HELLO


def test_oversized_frame_from_a_forged_active_is_refused_unread(
    intact: Pair, fake_active: FakeListener
) -> None:
    link = fake_active.accept()
    with link:
        link.send_raw(struct.pack(">IB", 1 << 30, FrameType.CHALLENGE))
        assert link.closed_by_peer() == []
    assert "out of range (limit 4096)" in _log(intact.passive)


def test_an_active_of_the_old_protocol_gets_no_hello_and_a_clear_log_line(
    intact: Pair, fake_active: FakeListener
) -> None:
    link = fake_active.accept()
    with link:
        # Version 1's challenge: an epoch the passive took on trust, no version.
        old = {"name": "a", "epoch": ABSURD, "nonce": "0" * 32}
        link.send(FrameType.CHALLENGE, json.dumps(old).encode())
        assert link.closed_by_peer() == []
    assert "protocol version 1, this broker speaks 3" in _log(intact.passive)


def test_an_active_of_protocol_2_gets_no_hello_and_a_clear_log_line(
    intact: Pair, fake_active: FakeListener
) -> None:
    """Protocol 2's catch-up carries no dedup window (DEDUP_KEYS, 3): the pair must not come up
    half-upgraded. An old passive meets a new active the same way: version 2 refuses every
    challenge but its own version, so it never gets a frame type it cannot read."""
    link = fake_active.accept()
    with link:
        challenge = Challenge(version=2, name="a", nonce=new_nonce())
        link.send(FrameType.CHALLENGE, challenge)
        assert link.closed_by_peer() == []
    assert "protocol version 2, this broker speaks 3" in _log(intact.passive)
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as raw:
        assert Challenge.model_validate_json(raw.expect(FrameType.CHALLENGE)).version == 3


# -- an authenticated active's corrupt chunk ----------------------------------------------


def test_a_corrupt_catch_up_chunk_is_refused_whole_and_never_acknowledged(
    intact: Pair, fake_active: FakeListener
) -> None:
    """A chunk whose ops do not decode: the passive drops the link, acknowledges nothing,
    and keeps none of it, not even the well-formed message before the bad bytes (the
    passive journals a chunk's bytes as received, so they must all decode first)."""
    passive = intact.passive
    before = queue_counts(status(passive), QUEUE)
    definitions = json.loads((passive.data_dir / "journal" / "definitions.json").read_text())
    (qid,) = [q["qid"] for q in definitions["queues"] if q["name"] == QUEUE]
    good = bytearray()
    encode_ops([StoredMessage(1 << 40, qid, "", QUEUE, b"", b"never kept", None)], good)
    link, challenge = fake_active.challenge()
    with link:
        hello = Hello.model_validate_json(link.expect(FrameType.HELLO))
        link.send(FrameType.WELCOME, welcome_for(TOKEN, challenge, hello, hello.epoch))
        link.expect(FrameType.SNAPSHOT)
        link.send_raw(encode_batch(1, BATCH_CATCHUP | BATCH_CATCHUP_LAST, good + b"\x07"))
        assert FrameType.CATCHUP_ACK not in link.closed_by_peer()
    assert "malformed ops: unknown op tag 7" in _log(passive)
    assert queue_counts(status(passive), QUEUE) == before


# -- authenticated peers with an absurd epoch ----------------------------------------------


def test_authenticated_passive_with_an_absurd_epoch_jump_is_refused(intact: Pair) -> None:
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as link:
        challenge = Challenge.model_validate_json(link.expect(FrameType.CHALLENGE))
        link.send(FrameType.HELLO, hello_for(TOKEN, challenge, "b", ABSURD))
        refuse = Refuse.model_validate_json(link.expect(FrameType.REFUSE))
        assert "max_epoch_jump" in refuse.reason
        link.closed_by_peer()
    assert str(ABSURD) in _epoch_refused(active)
    assert _metric(active, "twinmq_epoch_refused_total") >= 1


def test_authenticated_active_with_an_absurd_epoch_jump_is_refused(
    intact: Pair, fake_active: FakeListener
) -> None:
    passive = intact.passive
    link, challenge = fake_active.challenge()
    with link:
        hello = Hello.model_validate_json(link.expect(FrameType.HELLO))
        link.send(FrameType.WELCOME, welcome_for(TOKEN, challenge, hello, ABSURD))
        refuse = Refuse.model_validate_json(link.expect(FrameType.REFUSE))
        assert "max_epoch_jump" in refuse.reason
        assert link.closed_by_peer() == []  # no SNAPSHOT either
    assert str(ABSURD) in _epoch_refused(passive)


def test_authenticated_peer_is_served(intact: Pair) -> None:
    """The attacks above fail on their forgery, not on the test's own peer: a proven one gets in."""
    active = intact.active
    with RawLink.connect(active.host, active.replication_port) as link:
        challenge = Challenge.model_validate_json(link.expect(FrameType.CHALLENGE))
        hello = hello_for(TOKEN, challenge, "probe", 1)
        link.send(FrameType.HELLO, hello)
        welcome = Welcome.model_validate_json(link.expect(FrameType.WELCOME))
        assert welcome == welcome_for(TOKEN, challenge, hello, 1)
        # It goes no further (no SNAPSHOT): the real passive's link is never replaced.


def _epoch_refused(broker: BrokerProcess) -> str:
    """`replication.epoch_refused` of the broker's status ("" if none)."""
    data = status(broker)
    assert data is not None
    return str(data["replication"]["epoch_refused"] or "")


# -- the recovery: `twinmq-broker epoch show|set` -------------------------------------------


def _epoch_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "twinmq.broker.main", "epoch", *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def test_epoch_show_and_set_repair_a_wrong_epoch(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "data", name="wrong-epoch", extra_args=["--epoch", "1"])
    data = str(broker.data_dir)
    with broker:
        pass
    # What a forged frame left behind before this fix: every role change is now stale.
    (broker.data_dir / "epoch.json").write_text(json.dumps({"epoch": ABSURD}))
    with broker.start():
        code, _ = post_role(broker, "active", 2)
        assert code == 409
    shown = _epoch_cli("show", data)
    assert shown.returncode == 0 and f"epoch {ABSURD} " in shown.stdout
    refused = _epoch_cli("set", data, "2")
    assert refused.returncode == 2 and "without --force" in refused.stderr
    assert "WARNING" in refused.stderr
    assert f"epoch {ABSURD} " in _epoch_cli("show", data).stdout
    forced = _epoch_cli("set", data, "2", "--force")
    assert forced.returncode == 0 and "WARNING" in forced.stderr, forced.stderr
    assert f"epoch {ABSURD} -> 2" in forced.stdout
    assert "epoch 2 " in _epoch_cli("show", data).stdout
    with broker.start():
        code, body = post_role(broker, "active", 3)
        assert code == 200, body
        data_status = status(broker)
        assert data_status is not None and data_status["epoch"] == 3
    # Raising needs no force.
    raised = _epoch_cli("set", data, "7")
    assert raised.returncode == 0 and "epoch 3 -> 7" in raised.stdout
