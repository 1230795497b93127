"""Test helpers: a small tmpfs of a test's own, to fill a disk for real, and a producer of
transactions that runs until the full disk refuses one."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pika import BasicProperties
from pika.adapters.blocking_connection import BlockingChannel
from pika.exceptions import ChannelClosedByBroker


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
