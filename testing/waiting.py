"""Waiting for what nothing signals (a status field, a pod condition, a log line): one poll
loop, for the tests, e2e, the benchmarks, the demo and the local cluster.

A timeout here is a bound for a loaded, shared machine, never a timing assertion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

FIRST_PAUSE = 0.01


def _pauses(interval: float) -> Iterator[float]:
    """Pauses between polls: from 10 ms, half as long again each time, up to `interval`
    (a quick condition is seen at once; a slow one does not load what is polled)."""
    pause = min(FIRST_PAUSE, interval)
    while True:
        yield pause
        pause = min(pause * 1.5, interval)


def _timed_out(what: str, timeout: float, last: object) -> TimeoutError:
    shown = repr(last)
    shown = shown if len(shown) <= 500 else shown[:500] + "..."
    return TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {shown})")


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.1
) -> T:
    """Poll `check` until it returns something truthy and return that; raise `TimeoutError`
    naming `what` (and the last value) after `timeout` seconds. `interval` is the longest
    pause between polls."""
    deadline = time.monotonic() + timeout
    pauses = _pauses(interval)
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(next(pauses))


async def until(
    what: str, check: Callable[[], T | None], within: float = 60.0, interval: float = 0.01
) -> T:
    """`wait_for` inside a running event loop: the loop runs between polls (every 10 ms by
    default: what these wait for is usually another task of the same loop)."""
    deadline = time.monotonic() + within
    pauses = _pauses(interval)
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, within, last)
        await asyncio.sleep(next(pauses))
