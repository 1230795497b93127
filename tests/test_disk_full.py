"""A full disk blocks publishers and nacks what could not be written; nothing confirmed is lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from disks import PassiveOnSmallDisk, commit_until_refused, end_log_at_a_page, small_tmpfs
from jepsen import DiskFiller, log_since, log_size, queue_counts
from pamqp import commands
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.broker.commit import GroupCommitter
from twinmq.broker.connection import DEDUP_CLIENT_PROPERTY
from twinmq.broker.journal import Journal, JournalError, StoredMessage
from twinmq.broker.server import EXIT_JOURNAL_FAILED
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import NoSmallDisk, Pair, post_role, status
from twinmq.testing.queues import drain
from twinmq.testing.rawamqp import RawClient, encode
from twinmq.testing.waiting import wait_for


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of the test's own (needs root; skipped where mounting is refused)."""
    with small_tmpfs(tmp_path / "disk", "16m") as mount:
        yield mount


def wait_for_alarms(broker: BrokerProcess, expected: list[str]) -> None:
    """Poll the admin API until the broker reports exactly `expected` alarms."""
    wait_for(f"alarms {expected}", lambda: broker.admin.status().alarms == expected, 10)


def test_full_disk_nacks_blocks_and_recovers_without_losing_confirms(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (11 * 1024 * 1024))
    data = small_disk / "data"
    args = ["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)]
    broker = BrokerProcess(data, name="full", extra_args=args, log_path=small_disk.parent / "b.log")
    broker.start()
    params = pika.ConnectionParameters(port=broker.port, blocked_connection_timeout=3)
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare("full.q", durable=True)
    ch.confirm_delivery()
    confirmed: list[int] = []
    refused = None
    body = b"x" * 4096
    for i in range(5000):
        try:
            ch.basic_publish(
                "", "full.q", body + str(i).encode(), pika.BasicProperties(delivery_mode=2)
            )
        except (
            pika.exceptions.NackError,
            pika.exceptions.ConnectionBlockedTimeout,
            pika.exceptions.AMQPConnectionError,
        ) as exc:
            refused = exc
            break
        confirmed.append(i)
    assert refused is not None, "the disk never filled"
    assert confirmed, "nothing was confirmed before the disk filled"
    # The failed write raised the disk alarm (publishers blocked) ...
    wait_for_alarms(broker, ["disk"])
    # ... until space comes back: the alarm clears and publishing works again.
    filler.unlink()
    wait_for_alarms(broker, [])

    def published() -> pika.BlockingConnection | None:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters(port=broker.port))
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("", "full.q", body + b"after", pika.BasicProperties(delivery_mode=2))
        except (pika.exceptions.NackError, pika.exceptions.AMQPConnectionError):
            return None
        return conn

    wait_for("a confirmed publish once the disk has room", published, 10, interval=0.2).close()
    broker.kill()
    restarted = BrokerProcess(
        data, name="full", extra_args=args, port=broker.port, log_path=small_disk.parent / "b.log"
    ).start()
    try:
        conn = pika.BlockingConnection(pika.ConnectionParameters(port=restarted.port))
        ch = conn.channel()
        seen = set()
        while True:
            method, _props, got = ch.basic_get("full.q", auto_ack=True)
            if method is None:
                break
            seen.add(got[len(body) :].decode())
        conn.close()
    finally:
        restarted.stop()
    assert {str(i) for i in confirmed} <= seen, "a confirmed message was lost"
    assert "after" in seen
    assert "disk full" in (small_disk.parent / "b.log").read_text()


def _restart_and_drain(
    broker: BrokerProcess, data: Path, args: list[str], queue: str
) -> list[bytes]:
    broker.kill()
    restarted = BrokerProcess(data, name=broker.name, extra_args=args, port=broker.port).start()
    try:
        return drain(restarted.url, queue)
    finally:
        restarted.stop()


def test_full_disk_fails_tx_commit_and_never_sends_commit_ok(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (11 * 1024 * 1024))
    data = small_disk / "data"
    args = ["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)]
    broker = BrokerProcess(data, name="txfull", extra_args=args).start()
    conn = pika.BlockingConnection(
        pika.ConnectionParameters(port=broker.port, blocked_connection_timeout=3)
    )
    ch = conn.channel()
    ch.queue_declare("tx.q", durable=True)
    ch.tx_select()
    body = b"t" * 4096
    committed, _, failed = commit_until_refused(ch, "tx.q", body)
    assert failed is not None, "the disk never filled under a commit"
    assert failed.reply_code == 541 and "tx.commit failed" in failed.reply_text
    assert committed, "nothing was committed before the disk filled"
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()
    filler.unlink()
    seen = {b[len(body) :].decode() for b in _restart_and_drain(broker, data, args, "tx.q")}
    wanted = {f"{txn}.{i}" for txn in committed for i in range(10)}
    assert wanted <= seen, f"{len(wanted - seen)} messages of committed transactions were lost"


def test_a_resend_after_a_disk_full_nack_is_enqueued_once_space_returns(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (11 * 1024 * 1024))
    data = small_disk / "data"
    args = ["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)]
    broker = BrokerProcess(data, name="dedupfull", extra_args=args).start()
    params = pika.ConnectionParameters(
        port=broker.port,
        blocked_connection_timeout=3,
        client_properties={DEDUP_CLIENT_PROPERTY: True},
    )
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare("dd.q", durable=True)
    ch.confirm_delivery()
    body = b"d" * 4096
    nacked = None
    for i in range(5000):
        try:
            ch.basic_publish(
                "", "dd.q", body, pika.BasicProperties(delivery_mode=2, message_id=f"m{i}")
            )
        except pika.exceptions.NackError:
            nacked = i
            break
    assert nacked is not None, "the disk never filled"
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()
    filler.unlink()
    wait_for_alarms(broker, [])
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish(
        "", "dd.q", b"resent", pika.BasicProperties(delivery_mode=2, message_id=f"m{nacked}")
    )
    conn.close()
    bodies = _restart_and_drain(broker, data, args, "dd.q")
    assert b"resent" in bodies, "the re-send of a nacked message was swallowed as a duplicate"
    assert len([b for b in bodies if b == body]) >= nacked


class _Outcomes:
    """A group-commit waiter that records what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[int, bool]] = []

    def durable(self, batch: int, failed: bool = False) -> bool:
        self.told.append((batch, failed))
        return True


def test_a_failed_batch_is_never_acknowledged_by_a_later_write_that_succeeded(
    small_disk: Path,
) -> None:
    """After a full disk a later, smaller write can succeed: the earlier batch still fails."""
    (small_disk / "filler").write_bytes(b"\0" * (15 * 1024 * 1024))

    async def run() -> list[tuple[int, bool]]:
        journal = Journal(small_disk / "j", segment_bytes=64 * 1024 * 1024)
        journal.open()
        committer = GroupCommitter(journal, asyncio.get_running_loop())
        outcomes = _Outcomes()
        committer.await_durable(outcomes)
        big = StoredMessage(1, 1, "", "q", b"", b"x" * (4 * 1024 * 1024), None)
        small = StoredMessage(2, 1, "", "q", b"", b"y" * 1024, None)
        # Two separate journal writes, both finished before the commit round looks at
        # them: the first fails for lack of space, the second fits.
        committer.add([big])
        first = committer.flush_now()
        with contextlib.suppress(JournalError):
            await journal.sync(journal.stats.appended_lsn)
        committer.add([small])
        second = committer.flush_now()
        await journal.sync(journal.stats.appended_lsn)
        assert (first, second) == (1, 2)
        await committer._sync_once()  # one round over both batches
        await journal.close()
        return outcomes.told

    told = asyncio.run(run())
    assert (1, True) in told, f"batch 1's write failed but its waiters heard {told}"
    assert told[-1] == (2, False)
    assert (1, False) not in told


@pytest.mark.timeout(180)
def test_a_passive_whose_disk_fills_stops_and_loses_nothing_it_acknowledged(
    small_disk: Path, tmp_path: Path
) -> None:
    """The passive never acknowledges a batch it could not write; it exits (its memory
    holds what its disk does not), the active goes on alone, and after a restart the
    passive catches up: a failover then finds every confirmed message."""
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (11 * 1024 * 1024))
    pair = PassiveOnSmallDisk(small_disk, tmp_path, "disk-full-pair", replication_timeout=2)
    active, passive = pair.active, pair.passive
    try:
        conn = pika.BlockingConnection(pika.URLParameters(active.url))
        ch = conn.channel()
        ch.queue_declare("pair.q", durable=True)
        ch.confirm_delivery()
        wait_for("passive ready", lambda: (status(passive) or {})["replication"]["ready"], 30)
        body = b"p" * 4096
        total = 2000
        for i in range(total):
            ch.basic_publish(
                "", "pair.q", body + str(i).encode(), pika.BasicProperties(delivery_mode=2)
            )
        conn.close()
        assert passive.proc is not None
        assert passive.proc.wait(timeout=30) == EXIT_JOURNAL_FAILED
        assert "could not be journaled" in pair.passive_log.read_text()

        filler.unlink()
        passive = pair.restart_passive()
        wait_for("passive back", lambda: (status(passive) or {})["replication"]["ready"], 60)
        active.kill()
        assert post_role(passive, "active", 2)[0] == 200
        seen = {b[len(body) :].decode() for b in drain(passive.url, "pair.q")}
        assert seen == {str(i) for i in range(total)}, "a confirmed message was lost"
    finally:
        pair.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["declare", "delete"])
def test_a_passive_that_cannot_save_the_topology_on_a_full_disk_exits_75_not_silent(
    small_disk: Path, tmp_path: Path, change: str
) -> None:
    """Finding 10 (docs/reliability.md): a passive whose full disk refused the topology file
    (a declare on the active, or the definitions of a reconnect) lost its replication task
    and went silent: linked no more, never acknowledging, never exiting. It must exit 75
    (its memory holds a topology its disk does not) and recover after a restart; the active
    meanwhile goes on alone and confirms what its own disk holds. A queue deleted on the
    active the same (a refused change undone in memory is the active's; a passive stops)."""
    pair = PassiveOnSmallDisk(small_disk, tmp_path, "defs-full-pair", replication_timeout=1)
    active, passive = pair.active, pair.passive
    try:
        wait_for("passive ready", lambda: (status(passive) or {})["replication"]["ready"], 30)
        conn = pika.BlockingConnection(pika.URLParameters(active.url))
        ch = conn.channel()
        if change == "delete":
            ch.queue_declare("defs.q", durable=True)
            ch.queue_declare("gone.q", durable=True)
            wait_for("the passive has it", lambda: queue_counts(status(passive), "gone.q"), 10)
        end_log_at_a_page(active.url, passive.data_dir / "journal")
        filler = DiskFiller(small_disk)
        try:
            if change == "declare":
                ch.queue_declare("defs.q", durable=True)  # the passive must save the topology
            else:
                ch.queue_delete("gone.q")
            assert passive.proc is not None
            code = passive.proc.wait(timeout=30)
            assert code == EXIT_JOURNAL_FAILED, f"passive exited {code}, not 75"
            assert "could not save the topology" in pair.passive_log.read_text()
            # The degrade rule: the active confirms alone once the passive is gone.
            ch.confirm_delivery()
            ch.basic_publish("", "defs.q", b"alone", pika.BasicProperties(delivery_mode=2))
            conn.close()
        finally:
            filler.release()
        passive = pair.restart_passive()
        wait_for("passive back", lambda: (status(passive) or {})["replication"]["ready"], 60)
        active.kill()
        assert post_role(passive, "active", 2)[0] == 200
        assert drain(passive.url, "defs.q") == [b"alone"]
    finally:
        pair.stop()


def test_a_queue_declare_the_full_disk_refused_leaves_no_queue_to_confirm_into(
    small_disk: Path,
) -> None:
    """A durable queue.declare whose topology file the full disk refused failed (541) but
    left the queue in memory: a client that declared it again got declare-ok, its publishes
    were confirmed, and the restart dropped them all (recovery keeps only the messages of
    queues the topology file holds). The refused declare must leave no queue behind."""
    data = small_disk / "data"
    args = ["--disk-free-limit", "0"]
    broker = BrokerProcess(data, name="defsfull", extra_args=args).start()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    conn.channel().queue_declare("first.q", durable=True)  # a topology file exists
    end_log_at_a_page(broker.url, data / "journal")
    filler = DiskFiller(small_disk)
    try:
        with pytest.raises(pika.exceptions.AMQPError):
            conn.channel().queue_declare("late.q", durable=True)
    finally:
        filler.release()
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    ch.queue_declare("late.q", durable=True)  # the client's retry, space back
    ch.confirm_delivery()
    ch.basic_publish("", "late.q", b"confirmed", pika.BasicProperties(delivery_mode=2))
    conn.close()
    assert _restart_and_drain(broker, data, args, "late.q") == [b"confirmed"]


@pytest.mark.timeout(120)
def test_a_passive_on_a_full_disk_that_loses_its_link_exits_75_on_reconnecting(
    tmp_path: Path,
) -> None:
    """Finding 10 as the compound class met it: the passive's disk is full, its link
    drops (the matrix's link-silence rule under load) and it reconnects; saving the
    active's topology then fails. It must exit 75, not sit unlinked and silent."""
    try:
        pair = Pair(tmp_path, replication_timeout=1.0, disk_bytes=16 * 1024 * 1024).start()
    except NoSmallDisk as exc:
        pytest.skip(str(exc))
    try:
        passive = pair.passive
        mark = log_size(passive)
        filler = DiskFiller(passive.data_dir)
        try:
            pair.link.cut()
            pair.link.heal()
            assert passive.proc is not None
            assert passive.proc.wait(timeout=30) == EXIT_JOURNAL_FAILED
            assert "could not save the topology" in log_since(passive, mark)
        finally:
            filler.release()
        passive.start()
        pair.wait_healthy(30)
    finally:
        pair.stop()


_EX, _Q, _KEY = "topo.ex", "topo.q", "rk"
# Each topology change the full disk refuses, on a durable exchange "topo.ex" (direct) and
# queue "topo.q" holding one message, bound by "rk" where the change needs a binding.
_REFUSED_CHANGES: dict[str, tuple[bool, Callable[[BlockingChannel], object]]] = {
    "queue.delete": (False, lambda ch: ch.queue_delete(_Q)),
    "exchange.declare": (False, lambda ch: ch.exchange_declare("late.ex", durable=True)),
    "exchange.delete": (False, lambda ch: ch.exchange_delete(_EX)),
    "queue.bind": (False, lambda ch: ch.queue_bind(_Q, _EX, _KEY)),
    "queue.unbind": (True, lambda ch: ch.queue_unbind(_Q, _EX, _KEY)),
}


def _topology_as_before(url: str, bound: bool) -> None:
    """The state before the refused change: the queue with its message, the exchange routing
    into it exactly when `bound`, and no "late.ex"."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        # Confirmed: the caller kills the broker next, and the put-back message's confirm
        # also covers the purge before it (batches are durable in order).
        ch.confirm_delivery()
        assert ch.queue_declare(_Q, passive=True).method.message_count == 1
        ch.exchange_declare(_EX, passive=True)
        ch.basic_publish(_EX, _KEY, b"probe", pika.BasicProperties(delivery_mode=2))
        routed = ch.queue_declare(_Q, passive=True).method.message_count == 2
        assert routed == bound, f"{_EX} routes into {_Q}: {routed}, expected {bound}"
        if routed:
            ch.queue_purge(_Q)  # the probe and the message: put the message back
            ch.basic_publish("", _Q, b"kept", pika.BasicProperties(delivery_mode=2))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            conn.channel().exchange_declare("late.ex", passive=True)
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()


@pytest.mark.parametrize("change", list(_REFUSED_CHANGES))
def test_a_topology_change_the_full_disk_refused_is_undone_in_memory_too(
    small_disk: Path, change: str
) -> None:
    """The channel got 541 and memory kept the change (finding 11): a deleted queue that
    took no more messages came back with its messages at the next restart, a binding that
    routed until then stopped, and so on. Refused, each change must leave memory as the
    topology file is: the same before and after a restart."""
    bound, apply = _REFUSED_CHANGES[change]
    data = small_disk / "data"
    args = ["--disk-free-limit", "0"]
    broker = BrokerProcess(data, name="topofull", extra_args=args).start()
    try:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = conn.channel()
        ch.exchange_declare(_EX, "direct", durable=True)
        ch.queue_declare(_Q, durable=True)
        if bound:
            ch.queue_bind(_Q, _EX, _KEY)
        ch.confirm_delivery()
        ch.basic_publish("", _Q, b"kept", pika.BasicProperties(delivery_mode=2))
        end_log_at_a_page(broker.url, data / "journal")
        filler = DiskFiller(small_disk)
        try:
            with pytest.raises(pika.exceptions.AMQPError) as refused:
                apply(conn.channel())
        finally:
            filler.release()
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()
        _topology_as_before(broker.url, bound)
        broker.kill()
        broker = BrokerProcess(data, name=broker.name, extra_args=args, port=broker.port).start()
        _topology_as_before(broker.url, bound)
    finally:
        broker.stop()
    # The channel only, with why (not the connection's "internal error, see the log").
    error = refused.value
    assert isinstance(error, pika.exceptions.ChannelClosedByBroker), repr(error)
    assert error.reply_code == 541 and "the topology could not be saved" in error.reply_text


def test_a_group_of_pipelined_changes_the_full_disk_refused_is_refused_and_undone_whole(
    small_disk: Path,
) -> None:
    """The changes of one read are one group commit (one write of the definitions log):
    a full disk refuses all of them, each channel closed with the error its method would
    have got alone (541), none of them in memory or on disk, before and after a restart."""
    data = small_disk / "data"
    args = ["--disk-free-limit", "0"]
    broker = BrokerProcess(data, name="groupfull", extra_args=args).start()
    try:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = conn.channel()
        ch.exchange_declare(_EX, "direct", durable=True)
        ch.queue_declare(_Q, durable=True)
        ch.queue_bind(_Q, _EX, "kept")
        conn.close()
        end_log_at_a_page(broker.url, data / "journal")
        with RawClient(broker.host, broker.port) as client:
            client.handshake()
            for number in (1, 2, 3):
                client.open_channel(number)
            filler = DiskFiller(small_disk)
            try:
                client.send(
                    b"".join(
                        encode(n, commands.Queue.Bind(queue=_Q, exchange=_EX, routing_key=key))
                        for n, key in ((1, "a"), (1, "b"), (2, "c"), (3, "d"))
                    )
                )
                closes = [client.expect(commands.Channel.Close) for _ in range(3)]
            finally:
                filler.release()
        assert all(c.reply_code == 541 for c in closes), closes
        assert all("the topology could not be saved" in c.reply_text for c in closes)

        def routed_keys(url: str) -> set[str]:
            conn = pika.BlockingConnection(pika.URLParameters(url))
            try:
                ch = conn.channel()
                ch.queue_purge(_Q)
                ch.confirm_delivery()
                for key in ("kept", "a", "b", "c", "d"):
                    ch.basic_publish(_EX, key, key.encode())
                return {m.decode() for m in drain(url, _Q)}
            finally:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    conn.close()

        assert routed_keys(broker.url) == {"kept"}
        broker.kill()
        broker = BrokerProcess(data, name=broker.name, extra_args=args, port=broker.port).start()
        assert routed_keys(broker.url) == {"kept"}
    finally:
        broker.stop()
