"""Whether files changed since the last look (modification time and size), for the
settings a broker reloads without a restart: its TLS certificate, its users file."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

RELOAD_INTERVAL = 5.0  # seconds between looks at a reloadable file


async def reload_every(reload: Callable[[], object], interval: float = RELOAD_INTERVAL) -> None:
    """Call `reload` (a `reload_if_changed`) every `interval` seconds, for the broker's
    lifetime."""
    while True:
        await asyncio.sleep(interval)
        reload()


class FileWatch:
    """Remembers the (mtime, size) of some files; `changed` compares and remembers again."""

    def __init__(self, *paths: Path | None) -> None:
        self.paths = [p for p in paths if p is not None]
        self._seen = self._stamp()

    def _stamp(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in self.paths:
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((0, -1))  # missing for now (a Secret volume mid-update)
        return tuple(stamps)

    def forget(self) -> None:
        """Have the next `changed` say yes (a load that raced a replacement is redone)."""
        self._seen = ()

    def changed(self) -> bool:
        """Whether any file changed since the last call (or since creation)."""
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        return True
