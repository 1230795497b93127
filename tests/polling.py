"""Waiting, inside a running event loop, for what nothing signals (a kernel count, a log line)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(what: str, check: Callable[[], bool]) -> None:
    """Let the loop run until `check()`; fail naming `what` after 60 s (a bound for a
    loaded machine, not a timing assertion)."""
    for _ in range(6000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened within 60s: {what}")
