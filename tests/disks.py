"""Test helpers: a small tmpfs of a test's own, to fill a disk for real, a producer of
transactions that runs until the full disk refuses one, a pair whose passive has the
small disk, and a definitions log made to end at a page (so a full disk refuses the
next topology change)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pika
import pytest
from pika import BasicProperties
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import ChannelClosedByBroker

from twinmq.broker.definitions import BindingDef, DefinitionsDelta
from twinmq.broker.journal.segment import REC
from twinmq.broker.names import REPLICATION_TOKEN_ENV
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "16m") at `mount`; skip the test where mounting is refused.

    Needs root (or CAP_SYS_ADMIN); unmounted lazily afterwards.
    """
    mount.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def commit_until_refused(
    ch: BlockingChannel, queue: str, body: bytes, per_txn: int = 10, most: int = 1000
) -> tuple[list[int], int | None, ChannelClosedByBroker | None]:
    """Commit transactions of `per_txn` persistent messages (`body` + "txn.i") on a channel in
    tx mode until the broker refuses one (a full disk): the committed transaction numbers,
    the refused one and the channel error (None, None when `most` all went through)."""
    committed: list[int] = []
    for txn in range(most):
        for i in range(per_txn):
            ch.basic_publish(
                "", queue, body + f"{txn}.{i}".encode(), BasicProperties(delivery_mode=2)
            )
        try:
            ch.tx_commit()
        except ChannelClosedByBroker as exc:
            return committed, txn, exc
        committed.append(txn)
    return committed, None, None


class PassiveOnSmallDisk:
    """An active broker on the test's disk and its passive on a small one (`small`).

    Both run in epoch 1 with the given replication timeout and no disk-free limit, so the
    passive's disk can be filled for real. `restart_passive()` starts the passive again on
    the same port and data directory (after a disk-full exit); `stop()` ends both.
    """

    def __init__(self, small: Path, tmp_path: Path, token: str, replication_timeout: float) -> None:
        self.env = {REPLICATION_TOKEN_ENV: token}
        common = [
            "--epoch", "1", "--replication-timeout", str(replication_timeout),
            "--disk-free-limit", "0",
        ]  # fmt: skip
        self.passive_log = tmp_path / "b.log"
        self.active = BrokerProcess(tmp_path / "a", name="a", env=self.env, extra_args=common)
        self.active.start()
        self._passive_dir = small / "b"
        self._passive_args = [
            *common, "--role", "passive", "--replicate-from", self.active.replication_address,
        ]  # fmt: skip
        self.passive = self._start_passive()

    def _start_passive(self, **where: int) -> BrokerProcess:
        passive = BrokerProcess(
            self._passive_dir, name="b", env=self.env, extra_args=self._passive_args,
            log_path=self.passive_log, **where,
        )  # fmt: skip
        return passive.start()

    def restart_passive(self) -> BrokerProcess:
        """Start the passive again where it was (same port, data and log)."""
        self.passive = self._start_passive(port=self.passive.port)
        return self.passive

    def stop(self) -> None:
        """Kill the active and stop the passive."""
        self.active.kill()
        self.passive.stop()


PAD_EXCHANGE, PAD_QUEUE = "pad.x", "pad.q"


def _bind_record(key: str) -> bytes:
    """The definitions log's record of binding PAD_QUEUE to PAD_EXCHANGE by `key`, unframed."""
    delta = DefinitionsDelta(
        add_bindings=[BindingDef(exchange=PAD_EXCHANGE, queue=PAD_QUEUE, routing_key=key)]
    )
    return delta.model_dump_json(exclude_defaults=True).encode()


def _ends_with(path: Path, tail: bytes) -> bool:
    return path.read_bytes().endswith(tail)


def end_log_at_a_page(url: str, journal: Path, page: int = 4096) -> None:
    """Bind a pad queue (through `url`) by routing keys of chosen lengths until the
    definitions log of `journal` ends exactly at a page boundary.

    A topology change is a small append to that log, and an append that fits in the
    last page the file already has takes no space: a full tmpfs does not refuse it.
    A test of a refused change calls this before filling the disk, so that the change
    needs a new page. `journal` may be a passive's (the pad bindings replicate there,
    as records of the same bytes): each step waits for the record to land.
    """
    log = journal / "definitions.log"
    overhead = REC.size + len(_bind_record(""))
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.exchange_declare(PAD_EXCHANGE, "direct", durable=True)
        ch.queue_declare(PAD_QUEUE, durable=True)
        last = _bind_record("start")
        ch.queue_bind(PAD_QUEUE, PAD_EXCHANGE, "start")
        for n in range(100):
            wait_for("the pad binding in the log", partial(_ends_with, log, last), 30)
            room = -log.stat().st_size % page
            if room == 0:
                return
            length = room - overhead
            if not len(str(n)) < length <= 255:
                length = 200  # into the next page; the room is measured again
            key = str(n).ljust(length, "p")
            last = _bind_record(key)
            ch.queue_bind(PAD_QUEUE, PAD_EXCHANGE, key)
        raise AssertionError("the definitions log never ended at a page boundary")
    finally:
        conn.close()
