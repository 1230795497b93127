"""Futures for group-commit batches: a `Waiter` the mirror's two ends share."""

from __future__ import annotations

import asyncio
from collections import deque


class BatchFutures:
    """Hands out a future per batch, resolved (True) once the batch is complete or
    (False) if it failed. Register it once with the committer's `await_durable`."""

    def __init__(self) -> None:
        self.done = 0
        self._waiting: deque[tuple[int, asyncio.Future[bool]]] = deque()

    def wait(self, batch: int) -> asyncio.Future[bool]:
        """A future for `batch` (already resolved if it is done)."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if batch <= self.done:
            future.set_result(True)
        else:
            self._waiting.append((batch, future))
        return future

    def durable(self, batch: int, failed: bool = False) -> bool:
        """`Waiter`: batches up to `batch` are done (`batch` itself failed if `failed`)."""
        self.done = max(self.done, batch)
        waiting = self._waiting
        while waiting and waiting[0][0] <= batch:
            each, future = waiting.popleft()
            if not future.done():
                future.set_result(not (failed and each == batch))
        return True
