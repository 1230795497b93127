"""WriterThread: calls run in one thread, in order; the loop awaits their results."""

from __future__ import annotations

import asyncio
import threading

import pytest

from twinmq.broker.writerthread import WriterThread


def test_calls_run_in_order_in_one_other_thread_and_their_results_reach_the_loop() -> None:
    async def main() -> tuple[list[int], list[int], set[str]]:
        writer = WriterThread("test-writer")
        seen: list[int] = []
        threads: set[str] = set()

        def record(i: int) -> int:
            seen.append(i)
            threads.add(threading.current_thread().name)
            return i * 10

        results = await asyncio.gather(*(writer.call(record, i) for i in range(50)))
        writer.stop()
        return seen, results, threads

    seen, results, threads = asyncio.run(main())
    assert seen == list(range(50))
    assert results == [i * 10 for i in range(50)]
    assert threads == {"test-writer"}


def test_an_error_of_a_call_is_raised_where_it_is_awaited_and_later_calls_still_run() -> None:
    async def main() -> int:
        writer = WriterThread("test-writer")

        def fail() -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space left"):
            await writer.call(fail)
        result = await writer.call(len, "abc")
        writer.stop()
        return result

    assert asyncio.run(main()) == 3


def test_submitted_calls_run_before_stop_returns() -> None:
    writer = WriterThread("test-writer")
    done: list[str] = []
    writer.submit(done.append, "a")
    writer.submit(lambda: 1 / 0)  # logged, does not end the thread
    writer.submit(done.append, "b")
    writer.stop()
    assert done == ["a", "b"]
