"""A monotonic clock that moves only when the test says so (`broker.lease.Clock`), and
waiting on the real event loop for what real I/O does meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class FakeClock:
    """Monotonic time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0
        self.moved = asyncio.Condition()

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        until = self.now + seconds
        async with self.moved:
            await self.moved.wait_for(lambda: self.now >= until)

    async def advance_to(self, when: float) -> None:
        """Move to `when` and let every task that can run, run."""
        self.now = when
        async with self.moved:
            self.moved.notify_all()
        for _ in range(20):
            await asyncio.sleep(0)


async def until(what: str, check: Callable[[], bool]) -> None:
    """Let the real event loop run (HTTP round trips) until `check()`; fail after 30 s."""
    for _ in range(3000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")
