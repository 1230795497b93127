"""The one poll loop of the test rigs (twinmq.testing.waiting)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from twinmq.testing.waiting import until, wait_for


def counter(ready_at: int) -> tuple[list[int], Callable[[], int | None]]:
    """A check that fails `ready_at - 1` times, then returns the number of its calls."""
    calls: list[int] = []

    def check() -> int | None:
        calls.append(1)
        return len(calls) if len(calls) >= ready_at else None

    return calls, check


def test_wait_for_returns_the_first_truthy_value_of_the_check() -> None:
    calls, check = counter(ready_at=4)
    assert wait_for("the fourth call", check, timeout=60, interval=0.001) == 4
    assert len(calls) == 4


def test_wait_for_names_what_it_waited_for_and_the_last_value_when_it_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"waiting for the empty list \(last: \[\]\)"):
        wait_for("the empty list", list, timeout=0)


def test_an_error_of_the_check_ends_the_wait_at_once() -> None:
    def fails() -> int:
        raise RuntimeError("the process exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_for("a process that exited", fails, timeout=60)


def test_until_lets_the_event_loop_run_between_polls() -> None:
    async def main() -> int:
        done = asyncio.Event()
        asyncio.get_running_loop().call_soon(done.set)
        return await until("the other task", lambda: done.is_set() and 7)

    assert asyncio.run(main()) == 7


def test_until_times_out_like_wait_for() -> None:
    with pytest.raises(TimeoutError, match="never"):
        asyncio.run(until("never", lambda: 0, within=0))
