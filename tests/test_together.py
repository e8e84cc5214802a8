"""`together`: two awaitables at once, results or exceptions back, in fewer
passes of the event loop than `asyncio.gather`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest

from services.shared.together import together


async def one_pass(value: Any) -> Any:
    await asyncio.sleep(0)
    return value


async def round_trip(value: Any, passes: int = 1) -> Any:
    """A request whose answer the loop delivers `passes` passes later, as a
    reply read off a socket would be."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()

    def later(left: int) -> None:
        if left:
            loop.call_soon(later, left - 1)
        else:
            answer.set_result(value)

    later(passes)
    return await answer


async def fail(message: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(message)


async def passes_until_done(work: Awaitable[Any]) -> int:
    """How many passes of the loop `work` takes, counted by a callback that
    schedules itself once per pass."""
    loop = asyncio.get_running_loop()
    count = 0
    running = True

    def tick() -> None:
        nonlocal count
        if running:
            count += 1
            loop.call_soon(tick)

    loop.call_soon(tick)
    await work
    running = False
    return count


async def test_both_results_come_back_in_order() -> None:
    assert await together(one_pass("a"), one_pass("b")) == ("a", "b")


async def test_both_run_at_once() -> None:
    first_started, second_started = asyncio.Event(), asyncio.Event()

    async def meet(mine: asyncio.Event, theirs: asyncio.Event) -> str:
        mine.set()
        await asyncio.wait_for(theirs.wait(), 1)
        return "met"

    assert await together(meet(first_started, second_started),
                          meet(second_started, first_started)) == ("met", "met")


async def test_an_exception_is_returned_not_raised() -> None:
    early, late = await together(fail("first"), one_pass("b"))
    assert isinstance(early, ValueError) and str(early) == "first"
    assert late == "b"
    early, late = await together(one_pass("a"), fail("second"))
    assert early == "a"
    assert isinstance(late, ValueError) and str(late) == "second"


async def test_the_first_runs_in_the_callers_own_task() -> None:
    async def task_of() -> asyncio.Task[Any] | None:
        return asyncio.current_task()

    caller = asyncio.current_task()
    mine, other = await together(task_of(), task_of())
    assert mine is caller
    assert other is not caller


async def test_cancelling_the_caller_cancels_the_second() -> None:
    second_started, second_cancelled = asyncio.Event(), asyncio.Event()

    async def wait_forever() -> None:
        second_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            second_cancelled.set()
            raise

    caller = asyncio.create_task(together(asyncio.Event().wait(), wait_forever()))
    await second_started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(second_cancelled.wait(), 1)


async def test_it_never_takes_more_loop_passes_than_gather() -> None:
    gathered = await passes_until_done(
        asyncio.gather(round_trip(1), round_trip(2), return_exceptions=True))
    paired = await passes_until_done(together(round_trip(1), round_trip(2)))
    assert paired <= gathered


async def test_it_takes_fewer_loop_passes_when_the_first_answers_last() -> None:
    gathered = await passes_until_done(
        asyncio.gather(round_trip(1, passes=3), round_trip(2), return_exceptions=True))
    paired = await passes_until_done(together(round_trip(1, passes=3), round_trip(2)))
    assert paired < gathered
