"""One thread that runs calls in order, awaited from the event loop cheaply.

`loop.run_in_executor` with a `ThreadPoolExecutor` costs a few hundred Python
bytecodes per call (a `concurrent.futures.Future` with its condition variable,
a work item, the chaining of that future to an asyncio one): per group commit
that was a visible part of the audit log's cost per message (docs/benchmarks.md).
Here the loop puts `(call, future)` on a C `SimpleQueue`, the thread answers with
one `call_soon_threadsafe`; calls run one at a time, in the order they were made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# A call: the function, its arguments, and the loop and future to answer (None: no answer).
_Call = tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop | None, Any]


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class WriterThread:
    """Runs calls in one thread, in order; `call` returns an asyncio future of the result."""

    def __init__(self, name: str) -> None:
        self._calls: SimpleQueue[_Call | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run `fn(*args)` in the thread after the calls before it (on the event loop)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((fn, args, loop, future))
        return future

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Run `fn(*args)` in the thread, unawaited (an error is logged)."""
        self._calls.put((fn, args, None, None))

    def stop(self) -> None:
        """Run the calls already made, then end the thread (from any thread but its own)."""
        self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, args, loop, future = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the awaiting loop, or logged
                error = exc
            if loop is None:
                if error is not None:
                    log.error("%s: %r failed", self._thread.name, fn, exc_info=error)
                continue
            # A closed loop (RuntimeError) awaits nothing any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future, result, error)
