"""Test helpers: a small tmpfs of a test's own, to fill a disk for real, a producer of
transactions that runs until the full disk refuses one, and a pair whose passive has the
small disk."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pika import BasicProperties
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import ChannelClosedByBroker

from twinmq.broker.names import REPLICATION_TOKEN_ENV
from twinmq.testing.launcher import BrokerProcess


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
