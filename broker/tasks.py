"""Stopping a helper task from inside another task's `finally`."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any]) -> BaseException | None:
    """Cancel `task`, wait until it has finished, and return what it raised (None if it
    was cancelled or returned).

    Unlike `with suppress(CancelledError): await task`, a cancellation of the *caller*
    while it waits is not swallowed: it propagates, so a loop task being stopped stops
    instead of running its next round (a shutdown that waited for ever).
    """
    task.cancel()
    await asyncio.wait({task})
    return None if task.cancelled() else task.exception()
