"""The receiving side's durable dedup window: (origin, seq) keys already republished.

The keys live in a `DedupWindow` (broker/dedup.py: bounded, oldest forgotten first) and
in an append-only file, fsynced before the upstream is acknowledged; the file is
rewritten from the window when it holds twice the window's keys. Order per batch:
local group commit durable, then the keys durable here, then the upstream ack. A crash
between the first two lets one batch through twice on redelivery (the narrow gap left;
the mirror closes the same gap by journaling its mark in the same group commit).
"""

from __future__ import annotations

import os
from pathlib import Path

from twinmq.broker.dedup import DedupWindow


class DurableKeys:
    """A bounded window of keys, loaded from and appended to `path`."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.window = DedupWindow(size)
        self._lines = 0
        if path.exists():
            lines = path.read_text().splitlines()
            # A torn last line (crash mid-append) is a key never acknowledged: harmless.
            for key in lines[-size:]:
                self.window.add(key)
            self._lines = len(lines)

    def __contains__(self, key: str) -> bool:
        return key in self.window

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
