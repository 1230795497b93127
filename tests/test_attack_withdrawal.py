"""Attacks on the withdrawal of a failed batch from the passive (docs/replication.md, "A
failed batch on the passive", "Attacks tried").

A failure told (a `basic.nack`, a failed `tx.commit`) must leave nothing of its batch on
a promotable passive: not its messages, not its acknowledgements undone, and not the
dedup keys of its publishes, or a publisher's re-send under the same `message_id` (the
re-send docs/replication.md "Duplicates" promises is enqueued) is confirmed and dropped.

Real brokers on a tmpfs each (root only), the active's disk full, real pika clients, the
replication link through the test's proxy, `kill -9`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pika
import pika.exceptions
import pytest
from test_failed_batch_pair import InThread, _promote_after_kill, started_on_small_disks

from twinmq.broker.dedup import dedup_key
from twinmq.broker.replication.protocol import FrameType
from twinmq.testing.pair import Pair, status
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

QUEUE = "wd.q"
KEEP_FREE = 256 * 1024  # left on the active's disk: less than the transaction's publish
BIG = 1024 * 1024
ACKED = 10
ACKED_BYTES = 200 * 1024  # each acked message: its withdrawal stores it again on the passive
RATE = 200 * 1024  # the link's bytes per second while the transaction fails
MESSAGE_ID = "order-42"
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _pair(tmp_path: Path) -> contextlib.AbstractContextManager[Pair]:
    """A pair in sync on 32 MiB tmpfs each, deduplicating every publish, a replication
    timeout longer than the slow withdrawal below."""
    return started_on_small_disks(tmp_path, 30.0, ["--dedup-scope", "all"])


def _stored(pair: Pair) -> list[bytes]:
    """`ACKED` messages of `ACKED_BYTES` published and confirmed; their bodies."""
    bodies = [bytes([65 + i]) * ACKED_BYTES for i in range(ACKED)]
    conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    ch = conn.channel()
    ch.queue_declare(QUEUE, durable=True)
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", QUEUE, body, PERSISTENT)
    conn.close()
    return bodies


def _failed_tx(url: str) -> None:
    """Acks every stored message and publishes `BIG` bytes under `MESSAGE_ID` in one
    transaction; its commit fails (541: the active's disk is full)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    tx = conn.channel()
    tx.tx_select()
    tag = 0
    for _ in range(ACKED):
        method, _props, _body = tx.basic_get(QUEUE)
        assert method is not None
        tag = method.delivery_tag
    tx.basic_ack(tag, multiple=True)
    props = pika.BasicProperties(delivery_mode=2, message_id=MESSAGE_ID)
    tx.basic_publish("", QUEUE, b"T" * BIG, props)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as failed:
        tx.tx_commit()
    assert failed.value.reply_code == 541
    conn.close()


def _carries_the_publish(frame: bytes) -> bool:
    return frame[0] == FrameType.BATCH and MESSAGE_ID.encode() in frame


def _ping(frame: bytes) -> bool:
    return frame[0] == FrameType.PING


def _failing_while_the_passive_holds_it(pair: Pair) -> tuple[list[bytes], InThread]:
    """The stored messages, then the active's disk filled and the failing transaction
    started; the link passes its batch and holds what comes after (the withdrawal: the
    keys to forget, then the ops), pings aside, so the passive stays in touch. Returns
    once the passive has applied the batch and saved the publish's key in its window
    (every 5 s), the withdrawal still on its way."""
    bodies = _stored(pair)
    pair.link.hold_after(_carries_the_publish, passing=_ping)  # the passive reconnects
    pair.wait_healthy()
    data = pair.active.data_dir
    (data / "filler").write_bytes(b"\0" * (shutil.disk_usage(data).free - KEEP_FREE))
    commit = InThread(lambda: _failed_tx(pair.active.url))
    saved = pair.passive.data_dir / "dedup.json"
    wait_for(
        "the passive's saved window holds the failed publish's id",
        lambda: saved.exists() and MESSAGE_ID in saved.read_text(),
        30,
    )
    return bodies, commit


def _resent(url: str) -> None:
    """The publisher re-sends the failed publish under the same id, in confirm mode: it is
    confirmed (a basic.nack would raise)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    props = pika.BasicProperties(delivery_mode=2, message_id=MESSAGE_ID)
    ch.basic_publish("", QUEUE, b"R" * BIG, props)
    conn.close()


def _promoted_takes_the_resend(pair: Pair, bodies: list[bytes], why: str = "") -> None:
    """The active killed, the passive promoted: it holds `bodies` and takes the re-send."""
    _promote_after_kill(pair)
    _resent(pair.active.url)
    got = drain(pair.active.url, QUEUE)
    assert sorted(got) == sorted([*bodies, b"R" * BIG]), (
        f"{len(got)} messages; the re-send {'is' if b'R' * BIG in got else 'is NOT'} there{why}"
    )


@pytest.mark.slow
def test_a_resend_of_a_failed_publish_is_enqueued_by_a_passive_killed_right_after_the_failure(
    tmp_path: Path,
) -> None:
    """The transaction's batch reaches the passive, which admits its publish's key and
    saves its dedup window (every 5 s); the withdrawal, slowed by the link (it stores the
    10 acked messages again), forgets the key in memory and is acknowledged: the 541 is
    told. The passive is killed at once, before its next save, and started again: its
    journal no longer holds the message, its saved window still holds the key, and the
    catch-up discards nothing (the message is not there). Promoted, it would confirm the
    publisher's re-send of the failed publish and drop it (a confirmed message lost): the
    passive writes its window before it acknowledges the withdrawal."""
    with _pair(tmp_path) as pair:
        bodies = _stored(pair)
        pair.wait_healthy()
        data = pair.active.data_dir
        (data / "filler").write_bytes(b"\0" * (shutil.disk_usage(data).free - KEEP_FREE))
        # The batch (1 MiB) takes 5 s over the link, its withdrawal (2 MB) 10 s more:
        # the passive saves its window at least once while it holds the key.
        pair.link.throttle(RATE)
        commit = InThread(lambda: _failed_tx(pair.active.url))
        assert commit.done.wait(60), "the failure was never told"
        pair.passive.kill()  # at once: before its next save of the window
        assert commit.error is None, repr(commit.error)
        pair.link.throttle(None)
        saved = pair.passive.data_dir / "dedup.json"
        held = MESSAGE_ID in saved.read_text() if saved.exists() else False
        pair.note(f"the killed passive's dedup.json holds the failed publish's id: {held}")
        pair.passive.start()
        pair.wait_healthy()
        _promoted_takes_the_resend(pair, bodies, f"; the saved window held its id: {held}")


@pytest.mark.slow
def test_a_resend_of_a_failed_publish_is_enqueued_by_a_passive_killed_right_after_its_catch_up(
    tmp_path: Path,
) -> None:
    """The same through the other way a withdrawal ends: the passive holds the failed
    batch and has saved its key when the link is cut (the withdrawal still on its way);
    it reconnects and its catch-up discards the message (and the key, in memory): the
    541 is told. Killed at once, started again, promoted: it must take the re-send (it
    writes its window before it acknowledges the catch-up's end, and drops the keys it
    admitted when its next session begins: either guard alone passes this test, neither
    fails it)."""
    with _pair(tmp_path) as pair:
        bodies, commit = _failing_while_the_passive_holds_it(pair)
        assert not commit.done.is_set(), "the failure was told while the passive held it"
        pair.link.cut()  # the withdrawal, still on its way, is lost with the link
        pair.link.heal()
        assert commit.done.wait(60), "the failure was never told"
        pair.passive.kill()  # at once: before its next save of the window
        assert commit.error is None, repr(commit.error)
        pair.passive.start()
        pair.wait_healthy()
        _promoted_takes_the_resend(pair, bodies)


@pytest.mark.slow
def test_a_passive_killed_mid_withdrawal_and_restarted_holds_nothing_of_the_failed_batch(
    tmp_path: Path,
) -> None:
    """The passive applied the failed transaction's batch and is killed while the
    withdrawal is on its way; started again, it catches up, and only then is the 541
    told. Promoted, it holds the 10 acked messages, not the publish, and takes the
    publisher's re-send."""
    with _pair(tmp_path) as pair:
        bodies, commit = _failing_while_the_passive_holds_it(pair)
        pair.passive.kill()
        pair.link.heal()
        assert not commit.done.is_set(), "the failure was told while the passive held it"
        pair.passive.start()
        assert commit.done.wait(60), "the failure was never told"
        assert commit.error is None, repr(commit.error)
        _promoted_takes_the_resend(pair, bodies)


@pytest.mark.slow
def test_a_batch_failing_while_the_passive_catches_up_leaves_nothing_on_it_once_promoted(
    tmp_path: Path,
) -> None:
    """The passive was killed and started again; while its catch-up crawls over the
    throttled link, the transaction fails (its batch streamed live to the passive, which
    applies it): the active makes it catch up again. Once the 541 is told and the passive
    is in sync, the active is killed and the passive promoted: it holds the stored
    messages (the transaction's acks undone), those published while it was away, and
    not the transaction's publish."""
    with _pair(tmp_path) as pair:
        bodies = _stored(pair)
        pair.wait_healthy()
        pair.passive.kill()
        away = [bytes([97 + i]) * ACKED_BYTES for i in range(ACKED)]
        conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
        ch = conn.channel()
        for body in away:  # no confirms: they wait for the passive (the guard is on)
            ch.basic_publish("", QUEUE, body, PERSISTENT)
        conn.close()
        data = pair.active.data_dir
        pair.link.throttle(2 * RATE)
        pair.passive.start()
        passive = pair.passive
        wait_for(
            "the passive catching up",
            lambda: (
                (found := status(passive)) is not None
                and found["replication"]["link_connected"]
                and not found["replication"]["ready"]
            ),
            30,
        )
        (data / "filler").write_bytes(b"\0" * (shutil.disk_usage(data).free - KEEP_FREE))
        commit = InThread(lambda: _failed_tx(pair.active.url))
        assert commit.done.wait(90), "the failure was never told"
        assert commit.error is None, repr(commit.error)
        pair.link.throttle(None)
        pair.wait_healthy(60)
        _promote_after_kill(pair)
        assert sorted(drain(pair.active.url, QUEUE)) == sorted([*bodies, *away])


def test_a_caught_up_passive_keeps_no_dedup_key_its_active_lacks(tmp_path: Path) -> None:
    """A passive's saved window may hold the key of a message withdrawn since (killed after
    a catch-up chunk's discard was acknowledged, before its next write of the window): it
    starts again with the key and without the message. Its catch-up ends with the active's
    window, the only one it keeps: promoted, it takes the publisher's re-send."""
    with Pair(tmp_path, broker_args=["--dedup-scope", "all"]) as pair:
        pair.wait_healthy()
        conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
        ch = conn.channel()
        ch.queue_declare(QUEUE, durable=True)
        ch.confirm_delivery()
        ch.basic_publish("", QUEUE, b"kept", PERSISTENT)
        conn.close()
        pair.wait_healthy()
        pair.passive.kill()
        saved = pair.passive.data_dir / "dedup.json"
        window = json.loads(saved.read_text()) if saved.exists() else []
        saved.write_text(json.dumps([*window, dedup_key("", QUEUE, MESSAGE_ID)]))
        pair.passive.start()
        pair.wait_healthy()
        _promote_after_kill(pair)
        _resent(pair.active.url)
        assert sorted(drain(pair.active.url, QUEUE)) == [b"R" * BIG, b"kept"]
