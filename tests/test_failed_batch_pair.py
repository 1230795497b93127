"""A failure told to a client leaves nothing of its batch on the passive either.

A batch is streamed to the passive before the active's own write. When that write
fails (here: the active's disk is full) the active withdraws the batch and tells its
clients: a `basic.nack`, a failed `tx.commit`. The passive applied the batch already;
these tests kill the active right after the failure is told and promote the passive,
which must then hold exactly what the active held: no message of the failed batch,
every acknowledgement of the failed transaction undone (docs/replication.md, "A
failed batch on the passive").

Real brokers on a tmpfs each (root only, `Pair(disk_bytes=...)`), real pika clients;
only the active's disk is filled.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import NoSmallDisk, Pair, status
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

QUEUE = "fb.q"
KEEP_FREE = 256 * 1024  # left on the active's disk: less than a big message
BIG = 1024 * 1024
STORED = [f"m{i}".encode() for i in range(20)]
FAILED = re.compile(r"journal write failed, disk full: batch \d+ fails")
ALONE = "confirms now wait for the local disk only"
PERSISTENT = pika.BasicProperties(delivery_mode=2)


@contextlib.contextmanager
def started_on_small_disks(
    tmp_path: Path, replication_timeout: float, extra_args: Sequence[str] = ()
) -> Iterator[Pair]:
    """A pair in sync, each broker on a 32 MiB tmpfs, no free-space alarm (the disk fills
    for real), replicating through a link proxy the test controls; `extra_args` for both
    brokers. Skips where no tmpfs can be mounted (not root)."""
    rig = Pair(
        tmp_path, replication_timeout=replication_timeout, disk_bytes=32 * 1024 * 1024,
        broker_args=["--disk-free-limit", "0", "--segment-bytes", str(4 * BIG), *extra_args],
    )  # fmt: skip
    try:
        rig.start()
    except NoSmallDisk as exc:
        pytest.skip(str(exc))
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    """A long replication timeout: the active never goes on alone in these tests."""
    with started_on_small_disks(tmp_path, 20.0) as rig:
        yield rig


class InThread:
    """Runs a client's blocking call on a thread of its own; `error` once `done`."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(work,), daemon=True).start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


def _nacked_publish(pair: Pair) -> Callable[[], None]:
    """A confirm-mode publish too big for the active's disk, on a connection of its own."""
    url = pair.active.url

    def work() -> None:
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", QUEUE, b"N" * BIG, PERSISTENT)
        conn.close()

    return work


def _failure_logged(pair: Pair) -> None:
    """Wait until the active's log says a batch failed (its clients not told yet)."""
    log = pair.active.log_path
    assert log is not None
    wait_for("the active's batch failed", lambda: FAILED.search(log.read_text()), 20)


def _fill(pair: Pair) -> None:
    """Leave `KEEP_FREE` bytes on the active's disk (the passive's stays roomy)."""
    data = pair.active.data_dir
    (data / "filler").write_bytes(b"\0" * (shutil.disk_usage(data).free - KEEP_FREE))


def _stored(pair: Pair) -> tuple[pika.BlockingConnection, BlockingChannel]:
    """A connection to the active and a confirm channel; `STORED` published and confirmed."""
    conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    ch = conn.channel()
    ch.queue_declare(QUEUE, durable=True)
    ch.confirm_delivery()
    for body in STORED:
        ch.basic_publish("", QUEUE, body, PERSISTENT)
    return conn, ch


def _failed_tx(conn: pika.BlockingConnection) -> None:
    """A transaction that acks 10 stored messages and publishes one too big for the disk:
    its commit fails (541)."""
    tx = conn.channel()
    tx.tx_select()
    tag = 0
    for _ in range(10):
        method, _props, _body = tx.basic_get(QUEUE)
        assert method is not None
        tag = method.delivery_tag
    tx.basic_ack(tag, multiple=True)
    tx.basic_publish("", QUEUE, b"T" * BIG, PERSISTENT)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as failed:
        tx.tx_commit()
    assert failed.value.reply_code == 541


def _ready(broker: BrokerProcess) -> bool:
    """The broker's status says ready (a passive: promotable); False if it does not answer."""
    found = status(broker)
    return found is not None and bool(found["replication"]["ready"])


def failing_with_the_passive_paused(pair: Pair) -> InThread:
    """The active's disk filled, the passive paused (SIGSTOP), a transaction failing in a
    thread of its own; returns once the active logged the failed write."""
    _fill(pair)
    pair.passive.signal(signal.SIGSTOP)
    url = pair.active.url

    def failed_tx() -> None:
        own = pika.BlockingConnection(pika.URLParameters(url))
        _failed_tx(own)
        own.close()

    commit = InThread(failed_tx)
    _failure_logged(pair)
    return commit


def _promote_after_kill(pair: Pair) -> None:
    """kill -9 the active, promote the passive (it must be ready: caught up, in touch)."""
    pair.active.kill()
    passive = pair.passive
    wait_for("the passive ready", lambda: _ready(passive), 10)
    pair.promote_passive()


def test_a_passive_promoted_right_after_a_nack_holds_nothing_of_the_nacked_publish(
    pair: Pair,
) -> None:
    """Before, the passive kept the failed batch until its next catch-up: promoted in
    that window it delivered the nacked message."""
    _conn, ch = _stored(pair)
    _fill(pair)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", QUEUE, b"N" * BIG, PERSISTENT)
    _promote_after_kill(pair)
    assert sorted(drain(pair.active.url, QUEUE)) == sorted(STORED)


def test_a_passive_promoted_right_after_a_failed_commit_holds_nothing_of_the_transaction(
    pair: Pair,
) -> None:
    """Before, promoted in that window the passive delivered the failed transaction's
    publish and kept its acks (10 stored messages gone)."""
    conn, _ch = _stored(pair)
    _fill(pair)
    _failed_tx(conn)
    _promote_after_kill(pair)
    assert sorted(drain(pair.active.url, QUEUE)) == sorted(STORED)


def test_a_failure_waits_for_a_restarted_passive_to_catch_up_before_it_is_told(
    pair: Pair,
) -> None:
    """The passive is paused when the transaction's write fails, then killed and
    started again: the client hears of the failure only once the passive caught up
    from what the active holds, which it then keeps when promoted."""
    conn, _ch = _stored(pair)
    conn.close()
    commit = failing_with_the_passive_paused(pair)
    assert not commit.done.is_set(), "the failure was told while the passive might hold it"
    pair.passive.kill()
    pair.passive.start()
    assert commit.done.wait(30), "the failure was never told"
    assert commit.error is None, repr(commit.error)
    _promote_after_kill(pair)
    assert sorted(drain(pair.active.url, QUEUE)) == sorted(STORED)


def test_a_failure_on_a_cut_link_is_told_once_the_active_went_on_alone(tmp_path: Path) -> None:
    """The link is cut (silently) when the publish's write fails: the nack waits until
    the active goes on alone (with a Lease: once it marked it, so the passive is not
    promotable). The passive that comes back catches up and holds nothing of it."""
    with started_on_small_disks(tmp_path, 5.0) as pair:
        conn, _ch = _stored(pair)
        conn.close()
        _fill(pair)
        pair.link.partition()
        publish = InThread(_nacked_publish(pair))
        _failure_logged(pair)
        log = pair.active.log_path
        assert log is not None
        assert not publish.done.is_set(), "the nack was told while the passive might hold it"
        assert publish.done.wait(30), "the nack was never told"
        assert publish.error is None, repr(publish.error)
        assert ALONE in log.read_text(), "the nack was told before the active went on alone"
        passive = pair.passive
        wait_for("the passive no longer ready", lambda: not _ready(passive), 15)
        pair.link.heal()
        pair.wait_healthy()
        _promote_after_kill(pair)
        assert sorted(drain(pair.active.url, QUEUE)) == sorted(STORED)
