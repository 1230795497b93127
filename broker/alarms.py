"""Resource alarms: free disk and memory, checked once a second.

Like RabbitMQ, an alarm blocks publishing connections (`connection.blocked`)
instead of letting the broker fail: a full disk must never corrupt the journal.
A failed journal write, or an audit write that holds the confirms, raises the disk
alarm too: publishers learn why nothing is confirmed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from twinmq.broker import metrics
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.journal import DiskFullError

log = logging.getLogger(__name__)

# After a failed write, free space must exceed the limit by this much before publishers
# are let go again, so the alarm does not flap on the last few kilobytes.
DISK_FULL_MARGIN = 4 * 1024 * 1024


def process_rss_bytes() -> int:
    """Resident memory of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        return 0


def total_memory_bytes() -> int:
    """Physical memory of the machine (or the cgroup limit when lower)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


class ResourceMonitor:
    """Raises and clears the disk and memory alarms."""

    def __init__(
        self,
        data_dir: Path,
        disk_free_limit: int,
        memory_high_watermark: float,
        committer: GroupCommitter,
        on_change: Callable[[str | None], None],
    ) -> None:
        self.data_dir = data_dir
        self.disk_free_limit = disk_free_limit
        self.memory_limit = int(total_memory_bytes() * memory_high_watermark)
        self.committer = committer
        self.on_change = on_change
        self.reason: str | None = None
        # Further alarms checked after disk and memory (the mirror's flow control).
        self.checks: list[Callable[[], str | None]] = []

    def check(self) -> str | None:
        """The current alarm reason, or None."""
        free = shutil.disk_usage(self.data_dir).free
        failure = self.committer.failure
        if failure is not None:
            if not isinstance(failure, DiskFullError):
                # An I/O error leaves the journal refusing every write (as PostgreSQL
                # after a failed fsync): publishers stay blocked until a restart.
                return "disk"
            # A write failed for lack of space: stay blocked until there is clearly room.
            if free > self.disk_free_limit + DISK_FULL_MARGIN:
                self.committer.failure = None
            else:
                return "disk"
        if free < self.disk_free_limit or self.committer.audit_failure is not None:
            return "disk"
        if process_rss_bytes() > self.memory_limit:
            return "memory"
        for extra in self.checks:
            reason = extra()
            if reason is not None:
                return reason
        return None

    def update(self) -> None:
        """Check once and notify on change."""
        reason = self.check()
        if reason != self.reason:
            for resource in ("disk", "memory"):
                metrics.ALARM.labels(resource).set(1 if reason == resource else 0)
            self.reason = reason
            self.on_change(reason)

    async def run(self, interval: float = 1.0) -> None:
        """Check every `interval` seconds until cancelled."""
        while True:
            self.update()
            await asyncio.sleep(interval)
