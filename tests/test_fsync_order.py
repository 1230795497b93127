"""fdatasync before every positive completion, proven on real broker processes with strace.

A kill -9 test shows only that data reached the OS: the page cache survives
the process. A power loss does not forgive a confirm sent before the data was
synced, so these tests check the order itself. strace is attached to the
running broker(s); a pika client publishes one message (or one transaction) at
a time; `syscalls` parses the trace and requires, for every positive
completion, that a journal segment write holding the message's bytes was
followed by an fdatasync (or fsync) of that file which returned before the
completion began to be written:

- each basic.ack of a publisher confirm, on a single broker;
- each tx.commit-ok;
- a write that began a new segment also waits for the journal directory's fsync;
- in a pair, each confirm and tx.commit-ok of the active also only after it
  read the passive's ACK of the batch carrying the message, and each ACK the
  passive sent only after its own fdatasync of that batch;
- the audit log claims no more than survives a power loss: each confirm and
  tx.commit-ok only after the message's `confirmed-alone` (single broker) or
  `confirmed` (pair) audit record was written to the open audit segment and
  that file fdatasynced (a new segment's directory fsynced too), and each ACK of
  the passive only after its `replicated` record was.

A broker started with `--no-fsync` must fail the same checks: the checks can fail.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pika
import pytest
from syscalls import (
    Replication,
    Syscall,
    audit_problem,
    check_commits,
    check_confirms,
    check_passive_acks,
    is_audit_write,
    is_journal_write,
    parse,
)

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair
from twinmq.testing.waiting import wait_for

STRACE = shutil.which("strace")
# Everything a broker may write a socket or a segment with, read a socket with, or sync with.
TRACED = (
    "pwrite64,pwritev,pwritev2,write,writev,sendmsg,sendto,fdatasync,fsync,"
    "read,readv,recvfrom,recvmsg"
)
MESSAGES = 30
TRANSACTIONS = 10
PER_TRANSACTION = 3

pytestmark = pytest.mark.skipif(
    STRACE is None, reason="strace is not installed (`make system-deps` installs it)"
)


class Strace:
    """strace attached to a running process (all its threads) for a `with` block."""

    def __init__(self, pid: int, path: Path) -> None:
        self.pid = pid
        self.path = path
        self.errors = path.with_suffix(".stderr")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Strace:
        assert STRACE is not None
        # -f: every thread, -yy: fd paths and socket addresses, -xx -s: whole buffers in hex.
        args = [
            STRACE, "-f", "-tt", "-yy", "-xx", "-s", "65536", "-e", f"trace={TRACED}",
            "-o", str(self.path), "-p", str(self.pid),
        ]  # fmt: skip
        with open(self.errors, "wb") as err:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        attached = f"Process {self.pid} attached"
        proc = self.proc
        wait_for(
            f"strace attached to {self.pid}",
            lambda: proc.poll() is not None or attached in self.errors.read_text(),
            15,
        )
        if proc.poll() is not None:
            text = self.errors.read_text().strip()
            if "Operation not permitted" in text or "ptrace" in text:
                pytest.skip(f"ptrace is refused here, so strace cannot attach: {text}")
            raise RuntimeError(f"strace exited with {proc.returncode}: {text}")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # detaches, flushes the trace
            self.proc.wait(15)

    def calls(self) -> list[Syscall]:
        """The parsed trace (after the block)."""
        return parse(self.path.read_text().splitlines())


def bodies(prefix: str, n: int) -> list[bytes]:
    """`n` distinct bodies, long enough never to appear by chance in other bytes."""
    return [f"fsync-order-{prefix}-{i:04d}".encode() for i in range(n)]


def publish_confirmed(broker: BrokerProcess, queue: str, messages: list[bytes]) -> None:
    """One persistent message at a time, each waiting for its confirm."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        channel.confirm_delivery()
        for body in messages:
            channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def publish_transactions(broker: BrokerProcess, queue: str, txs: list[list[bytes]]) -> None:
    """One transaction of persistent messages at a time, each committed before the next."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        channel.tx_select()
        for tx in txs:
            for body in tx:
                channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
            channel.tx_commit()
    finally:
        connection.close()


def transactions(prefix: str) -> list[list[bytes]]:
    """TRANSACTIONS groups of PER_TRANSACTION distinct bodies."""
    flat = bodies(prefix, TRANSACTIONS * PER_TRANSACTION)
    return [flat[i : i + PER_TRANSACTION] for i in range(0, len(flat), PER_TRANSACTION)]


def verdict(problems: list[str]) -> str:
    """The first problems, one a line, for an assertion message."""
    return f"{len(problems)} problems:\n" + "\n".join(problems[:10])


# -- one broker -------------------------------------------------------------------------------


def test_each_confirm_follows_a_completed_fdatasync_of_its_message_and_its_audit_record(
    fresh_broker: BrokerProcess, tmp_path: Path
) -> None:
    assert fresh_broker.proc is not None
    sent = bodies("confirm", MESSAGES)
    with Strace(fresh_broker.proc.pid, tmp_path / "broker.trace") as trace:
        publish_confirmed(fresh_broker, "fsync-order-confirms", sent)
    calls = trace.calls()
    problems = check_confirms(
        calls, amqp_port=fresh_broker.port, bodies=sent, audit_event="confirmed-alone"
    )
    assert not problems, verdict(problems)
    # The check asks for the order, not only the sync: before the first audit write,
    # no record was durable.
    first_audit_write = min(c.entry for c in calls if is_audit_write(c))
    assert audit_problem(calls, sent[0], "confirmed-alone", first_audit_write)


def test_each_tx_commit_ok_follows_completed_fdatasyncs_of_its_transaction_and_audit_records(
    fresh_broker: BrokerProcess, tmp_path: Path
) -> None:
    assert fresh_broker.proc is not None
    txs = transactions("tx")
    with Strace(fresh_broker.proc.pid, tmp_path / "broker.trace") as trace:
        publish_transactions(fresh_broker, "fsync-order-tx", txs)
    problems = check_commits(
        trace.calls(), amqp_port=fresh_broker.port, transactions=txs, audit_event="confirmed-alone"
    )
    assert not problems, verdict(problems)


def test_a_confirm_whose_write_began_a_segment_follows_the_directory_fsync(
    tmp_path: Path,
) -> None:
    # 4 KiB segments and 1 KiB messages: a new segment every few messages; its
    # name must be durable (the journal directory fsynced) before the confirm.
    sent = [body + b"." * 1024 for body in bodies("roll", MESSAGES)]
    args = ["--segment-bytes", "4096"]
    with BrokerProcess(tmp_path / "data", name="small-segments", extra_args=args) as broker:
        assert broker.proc is not None
        with Strace(broker.proc.pid, tmp_path / "broker.trace") as trace:
            publish_confirmed(broker, "fsync-order-roll", sent)
    calls = trace.calls()
    began = [c for c in calls if is_journal_write(c) and c.offset == 0]
    assert len(began) >= 3, "the messages did not roll the journal over"
    problems = check_confirms(calls, amqp_port=broker.port, bodies=sent)
    assert not problems, verdict(problems)


def test_the_check_catches_a_broker_that_confirms_without_fdatasync(tmp_path: Path) -> None:
    # The negative control: with fsync off the broker confirms what only the page
    # cache holds, and the same check must say so for every message.
    sent = bodies("unsynced", 10)
    with BrokerProcess(tmp_path / "data", name="no-fsync", extra_args=["--no-fsync"]) as broker:
        assert broker.proc is not None
        with Strace(broker.proc.pid, tmp_path / "broker.trace") as trace:
            publish_confirmed(broker, "fsync-order-unsynced", sent)
    calls = trace.calls()
    problems = check_confirms(calls, amqp_port=broker.port, bodies=sent)
    assert len(problems) == len(sent), verdict(problems)
    assert all("no journal write holding it was made durable" in p for p in problems)
    # The audit records were written (to the OS) but never fdatasynced: caught too.
    assert any(is_audit_write(c) for c in calls), "no audit write in the trace"
    confirms_at = len(calls) * 2 + 1  # after everything in the trace
    unsynced = [b for b in sent if audit_problem(calls, b, "confirmed-alone", confirms_at)]
    assert unsynced == sent


# -- a pair -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One in-sync pair for the module; a generous replication timeout, as strace slows it."""
    with Pair(tmp_path_factory.mktemp("pair"), replication_timeout=5.0) as started:
        yield started


def traced_pair(pair: Pair, tmp_path: Path) -> tuple[Strace, Strace]:
    """Tracers for the active and the passive (enter both)."""
    active, passive = pair.active.proc, pair.passive.proc
    assert active is not None and passive is not None
    return Strace(active.pid, tmp_path / "active.trace"), Strace(
        passive.pid, tmp_path / "passive.trace"
    )


def test_in_a_pair_each_confirm_follows_both_fdatasyncs_both_audit_records_and_the_ack(
    pair: Pair, tmp_path: Path
) -> None:
    sent = bodies("pair-confirm", MESSAGES)
    on_active, on_passive = traced_pair(pair, tmp_path)
    with on_active, on_passive:
        publish_confirmed(pair.active, "fsync-order-pair-confirms", sent)
    # The active waited for the passive only while it was in sync: say so if it was not.
    assert pair.healthy(), "the pair fell out of sync while traced"
    link = Replication(local_port=pair.active.replication_port)
    active = check_confirms(
        on_active.calls(),
        amqp_port=pair.active.port,
        bodies=sent,
        replication=link,
        audit_event="confirmed",
    )
    assert not active, "active: " + verdict(active)
    passive = check_passive_acks(
        on_passive.calls(), active_port=pair.link.port, bodies=sent, audit_event="replicated"
    )
    assert not passive, "passive: " + verdict(passive)


def test_in_a_pair_each_tx_commit_ok_follows_both_fdatasyncs_audit_records_and_the_ack(
    pair: Pair, tmp_path: Path
) -> None:
    txs = transactions("pair-tx")
    on_active, on_passive = traced_pair(pair, tmp_path)
    with on_active, on_passive:
        publish_transactions(pair.active, "fsync-order-pair-tx", txs)
    assert pair.healthy(), "the pair fell out of sync while traced"
    link = Replication(local_port=pair.active.replication_port)
    active = check_commits(
        on_active.calls(),
        amqp_port=pair.active.port,
        transactions=txs,
        replication=link,
        audit_event="confirmed",
    )
    assert not active, "active: " + verdict(active)
    flat = [body for tx in txs for body in tx]
    passive = check_passive_acks(
        on_passive.calls(), active_port=pair.link.port, bodies=flat, audit_event="replicated"
    )
    assert not passive, "passive: " + verdict(passive)
