"""Waiting for what nothing signals (a status field, a pod condition, a log line): one poll
loop, for the tests, e2e, the benchmarks, the demo and the local cluster.

A timeout here is a bound for a loaded, shared machine, never a timing assertion.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

FIRST_PAUSE = 0.01


class _Poll(Generic[T]):
    """One wait: the check, its deadline and the pauses between calls (from 10 ms, half
    as long again each time, up to `interval`: a quick condition is seen at once, a slow
    one does not load what is polled)."""

    def __init__(
        self, what: str, check: Callable[[], T | None], timeout: float, interval: float
    ) -> None:
        self.what, self.check, self.timeout, self.interval = what, check, timeout, interval
        self.deadline = time.monotonic() + timeout
        self.pause = min(FIRST_PAUSE, interval)

    def once(self) -> T | None:
        """The check's value; None to poll again after `next_pause()`; `TimeoutError`
        naming what and the last value once past the deadline."""
        value = self.check()
        if not value and time.monotonic() >= self.deadline:
            shown = repr(value)
            shown = shown if len(shown) <= 500 else shown[:500] + "..."
            raise TimeoutError(
                f"timed out after {self.timeout}s waiting for {self.what} (last: {shown})"
            )
        return value or None

    def next_pause(self) -> float:
        """How long to sleep before the next call."""
        pause, self.pause = self.pause, min(self.pause * 1.5, self.interval)
        return pause


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.1
) -> T:
    """Poll `check` until it returns something truthy and return that; raise `TimeoutError`
    naming `what` (and the last value) after `timeout` seconds. `interval` is the longest
    pause between polls."""
    poll = _Poll(what, check, timeout, interval)
    while (value := poll.once()) is None:
        time.sleep(poll.next_pause())
    return value


async def until(
    what: str, check: Callable[[], T | None], within: float = 60.0, interval: float = 0.01
) -> T:
    """`wait_for` inside a running event loop: the loop runs between polls (every 10 ms by
    default: what these wait for is usually another task of the same loop)."""
    poll = _Poll(what, check, within, interval)
    while (value := poll.once()) is None:  # noqa: ASYNC110 - nothing to await: it polls
        await asyncio.sleep(poll.next_pause())
    return value


def accepts(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port is accepted now (a check for `wait_for`: a
    Service answers once the endpoint controller and kube-proxy have caught up, after the
    pods behind it are Ready)."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True
