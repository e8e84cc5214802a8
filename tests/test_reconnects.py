"""The steps a process runs each time NATS comes back: in order, each until
it succeeds, and from the start again when NATS comes back once more."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.shared.reconnects import Reconnects, cancel_until_done


class Journal:
    """What the steps did, in order; waited on as it grows."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        self._grew = asyncio.Event()

    def add(self, entry: str) -> None:
        self.entries.append(entry)
        self._grew.set()

    async def reaches(self, count: int) -> None:
        async with asyncio.timeout(5):
            while len(self.entries) < count:
                self._grew.clear()
                await self._grew.wait()


class Step:
    """A restore step that fails its first `failures` tries."""

    def __init__(self, name: str, journal: Journal, failures: int = 0) -> None:
        self._name, self._journal, self._failures = name, journal, failures
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self) -> None:
        await self.release.wait()
        if self._failures > 0:
            self._failures -= 1
            self._journal.add(f"{self._name} failed")
            raise ConnectionError("NATS away again")
        self._journal.add(f"{self._name} done")


async def test_each_step_runs_in_order_and_is_retried_until_it_succeeds() -> None:
    journal = Journal()
    reconnects = Reconnects(retry_s=0.01)
    reconnects.add(Step("layout", journal, failures=2))
    reconnects.add(Step("consumers", journal))
    await reconnects.on_reconnect()
    await journal.reaches(4)
    await reconnects.stop()
    assert journal.entries == ["layout failed", "layout failed", "layout done",
                               "consumers done"]


async def test_coming_back_again_mid_restore_starts_it_over() -> None:
    journal = Journal()
    reconnects = Reconnects(retry_s=0.01)
    layout, consumers = Step("layout", journal), Step("consumers", journal)
    reconnects.add(layout)
    reconnects.add(consumers)
    consumers.release.clear()  # the first restore hangs on its second step
    await reconnects.on_reconnect()
    await journal.reaches(1)
    await reconnects.on_reconnect()
    consumers.release.set()
    await journal.reaches(3)
    await reconnects.stop()
    # The hung step of the first restore was cancelled, not finished twice.
    assert journal.entries == ["layout done", "layout done", "consumers done"]


async def test_a_step_failing_for_long_is_tried_again_less_and_less_often() -> None:
    journal, pauses = Journal(), list[float]()

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    reconnects = Reconnects(sleep=pause)
    reconnects.add(Step("layout", journal, failures=7))
    await reconnects.on_reconnect()
    await journal.reaches(8)
    await reconnects.stop()
    assert pauses == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


async def test_a_task_that_misses_its_cancel_is_cancelled_again_until_it_ends() -> None:
    """As nats-py's reconnect loop does when a cancel lands as a refused
    connection fails: the cancel reads as one more failed try."""
    started, missed = asyncio.Event(), asyncio.Event()

    async def retrying() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            missed.set()  # taken for a failed try: on to the next
        await asyncio.Event().wait()

    task = asyncio.create_task(retrying())
    await started.wait()
    assert await cancel_until_done(task)
    assert missed.is_set() and task.cancelled()


async def test_a_task_that_will_not_end_is_given_up_on_within_the_bound() -> None:
    started, giving_up = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        started.set()
        while not giving_up.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

    task = asyncio.create_task(stubborn())
    await started.wait()
    assert not await cancel_until_done(task, tries=3, wait_s=0.01)
    giving_up.set()
    task.cancel()
    await task  # ends by itself now


async def test_a_cancel_of_the_one_waiting_lands_while_the_task_ends() -> None:
    """A restore stopping the settings watch (`LiveSettings.stop`) or an older
    restore is itself cancelled, by a newer reconnect or the service's stop:
    the cancel must land, not be taken for the task's own ending, or the old
    restore runs on beside the new one."""
    started, ending, let_end = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_to_end() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ending.set()
            await let_end.wait()
            raise

    task = asyncio.create_task(slow_to_end())
    await started.wait()
    stopping = asyncio.create_task(cancel_until_done(task, tries=1, wait_s=60))
    await ending.wait()  # asked to end and ending: the stopper waits for it
    stopping.cancel()
    let_end.set()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    await asyncio.wait({task})
    assert task.cancelled()
