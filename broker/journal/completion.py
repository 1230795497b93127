"""Which appended groups are done, which failed, and the futures waiting for them.

Journal positions (`lsn`) number the groups `Journal.append` buffers, 1, 2, ...;
the writer finishes them in order, a whole group commit (a range of lsns) at a
time, either durably or with an error for the whole range. Loop side only.
"""

from __future__ import annotations

import asyncio
import heapq

from twinmq.broker.journal.errors import JournalError

__all__ = ["Completions"]


class Completions:
    """lsn bookkeeping: appended, finished, failed ranges, waiters."""

    def __init__(self) -> None:
        self.appended = 0  # the last lsn handed out
        self.done = 0  # the last lsn whose write finished, either way
        self._failed: list[tuple[int, int, JournalError]] = []  # merged lsn ranges
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap by lsn
        self._seq = 0
        self._idle: list[asyncio.Future[None]] = []

    def next(self) -> int:
        """The lsn of a group just appended."""
        self.appended += 1
        return self.appended

    def succeeded(self, hi: int) -> None:
        """Every group up to `hi` is durable (those not failed before)."""
        self.done = hi
        self._wake()

    def failed(self, lo: int, hi: int, exc: JournalError) -> None:
        """The groups `lo`..`hi` were rolled back with `exc`."""
        if self._failed and self._failed[-1][1] == lo - 1:
            self._failed[-1] = (self._failed[-1][0], hi, exc)
        else:
            self._failed.append((lo, hi, exc))
        self.done = hi
        self._wake()

    def raise_if_failed(self, lsn: int) -> None:
        """Raise the error of the write that held `lsn`, if it failed."""
        for lo, hi, exc in reversed(self._failed):
            if lo <= lsn <= hi:
                raise type(exc)(str(exc)) from exc
            if hi < lsn:
                return

    async def wait(self, lsn: int) -> None:
        """Return once `lsn` is done; raise its write's error if it failed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiters, (lsn, self._seq, fut))
        await fut

    def idle_future(self) -> asyncio.Future[None]:
        """A future the writer resolves once it has nothing left to do."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle.append(fut)
        return fut

    def idle(self) -> None:
        """The writer has nothing left to do."""
        for fut in self._idle:
            if not fut.done():
                fut.set_result(None)
        self._idle.clear()

    def fail_all(self, exc: JournalError) -> None:
        """The journal stopped: every waiter gets `exc`."""
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(JournalError(str(exc)))
        self._waiters.clear()
        for fut in self._idle:
            if not fut.done():
                fut.set_exception(JournalError(str(exc)))
        self._idle.clear()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= self.done:
            lsn, _, fut = heapq.heappop(waiters)
            if fut.done():
                continue  # the caller was cancelled; the write went ahead anyway
            try:
                self.raise_if_failed(lsn)
            except JournalError as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)
