"""A monotonic clock that moves only when the test says so (`broker.lease.Clock`)."""

from __future__ import annotations

import asyncio


class FakeClock:
    """Monotonic time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0
        self.moved = asyncio.Condition()
        self.sleeping = 0  # tasks asleep on this clock right now

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        until = self.now + seconds
        self.sleeping += 1
        try:
            async with self.moved:
                await self.moved.wait_for(lambda: self.now >= until)
        finally:
            self.sleeping -= 1

    async def advance_to(self, when: float) -> None:
        """Move to `when` and let every task that can run, run."""
        self.now = when
        async with self.moved:
            self.moved.notify_all()
        for _ in range(20):
            await asyncio.sleep(0)
