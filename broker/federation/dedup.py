"""The receiving side's durable dedup window: (origin, seq) keys already republished.

One window per server, shared by all its links: a message that reaches this server by
two paths (a triangle, a diamond) carries the same key on both and is republished once.
A key is *claimed* while its republish is in flight, so the other path's copy is dropped
then too; if the republish fails, the claim is released and the first path's upstream
re-delivers it (never acknowledged), so dropping the second copy loses nothing.

The keys live in a `DedupWindow` (broker/dedup.py: bounded, oldest forgotten first) and
in an append-only file, fsynced before the upstream is acknowledged; the file is
rewritten from the window when it holds twice the window's keys. Order per batch:
local group commit durable, then the keys durable here, then the upstream ack. A crash
between the first two lets one batch through twice on redelivery (the narrow gap left;
the mirror closes the same gap by journaling its mark in the same group commit).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from twinmq.broker.dedup import DedupWindow


class DurableKeys:
    """A bounded window of keys, loaded from and appended to `path`."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.window = DedupWindow(size)
        self.claimed: set[str] = set()
        self._lines = 0
        self._writing = asyncio.Lock()
        if path.exists():
            lines = path.read_text().splitlines()
            # A torn last line (crash mid-append) is a key never acknowledged: harmless.
            for key in lines[-size:]:
                self.window.add(key)
            self._lines = len(lines)

    def __contains__(self, key: str) -> bool:
        return key in self.claimed or key in self.window

    def claim(self, key: str) -> None:
        """A republish of `key` is in flight: copies of it are duplicates meanwhile."""
        self.claimed.add(key)

    async def settle(self, durable: list[str], failed: list[str]) -> None:
        """Make the keys of durable republishes durable here, release the failed ones."""
        async with self._writing:
            await asyncio.get_running_loop().run_in_executor(None, self.write, durable)
        self.claimed.difference_update(durable)
        self.claimed.difference_update(failed)

    def __len__(self) -> int:
        return len(self.window)

    def write(self, keys: list[str]) -> None:
        """Make `keys` durable and remember them (runs in a worker thread; blocking)."""
        if not keys:
            return
        for key in keys:
            self.window.add(key)
        self._lines += len(keys)
        if self._lines > 2 * self.window.size:
            self._rewrite()
            return
        with open(self.path, "a") as f:
            f.write("".join(k + "\n" for k in keys))
            f.flush()
            os.fsync(f.fileno())

    def _rewrite(self) -> None:
        keys = self.window.keys()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write("".join(k + "\n" for k in keys))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(keys)
