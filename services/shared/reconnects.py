"""What a process does each time NATS comes back.

nats-py replays core subscriptions by itself, but what lives in JetStream
may be gone: a memory stream always is after a restart, and a server that
lost its store (`docker compose down -v`, a new server) has no stream,
bucket or consumer at all. So every reconnect runs the process's restore
steps in order (the JetStream layout first, then what its parts made in the
server: durable consumers, followers, watchers), each retried until it
succeeds (after pauses doubling from 0.5 s to 10 s), in a task of its own:
nats-py waits for its reconnect callback before it goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

Step = Callable[[], Awaitable[None]]
Sleep = Callable[[float], Awaitable[None]]
# A step that fails is tried again after RETRY_S, doubling up to MOST_RETRY_S:
# a server that refuses for long is not asked twice a second all that while.
RETRY_S = 0.5
MOST_RETRY_S = 10.0
# A task that missed its cancel is cancelled again this often, this far apart.
CANCELS = 20
CANCEL_WAIT_S = 0.1
log = structlog.get_logger()


class Reconnects:
    def __init__(self, retry_s: float = RETRY_S, sleep: Sleep = asyncio.sleep) -> None:
        self._steps: list[Step] = []
        self._retry_s = retry_s
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    def add(self, step: Step) -> None:
        self._steps.append(step)

    async def on_reconnect(self) -> None:
        """nats-py's reconnected callback: restore, starting over if a
        restore is still under way (the server went away again meanwhile)."""
        log.info("nats_reconnected")
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.create_task(self._restore())

    async def stop(self) -> None:
        if self._task is not None and not await cancel_until_done(self._task):
            log.warning("jetstream_restore_not_ended")

    async def _restore(self) -> None:
        for step in self._steps:
            await self._until_done(step)
        log.info("jetstream_restored")

    async def _until_done(self, step: Step) -> None:
        await until_done(step, "jetstream_restore_failed", self._retry_s,
                         max(MOST_RETRY_S, self._retry_s), self._sleep,
                         step=getattr(step, "__qualname__", ""))


async def until_done(attempt: Step, failed: str, first_s: float, most_s: float,
                     sleep: Sleep = asyncio.sleep, **logged: str) -> int:
    """`attempt`, tried again after each failure (logged as `failed`), `first_s`
    later and doubling up to `most_s`: a server that refuses for long is not
    asked twice a second all that while. Returns how many tries failed."""
    delay, failures = first_s, 0
    while True:
        try:
            await attempt()
            return failures
        except Exception as err:  # NATS away again, still starting up, or refusing
            log.warning(failed, **logged, error=f"{type(err).__name__}: {err}",
                        retry_in_s=delay)
        failures += 1
        await sleep(delay)
        delay = min(delay * 2, most_s)


async def cancel_until_done(task: asyncio.Task[Any], tries: int = CANCELS,
                            wait_s: float = CANCEL_WAIT_S) -> bool:
    """Cancel `task` until it has ended, at most `tries` times; whether it has.
    A cancel can be missed: Python 3.11's `asyncio.wait_for` turns one that
    lands as its inner call fails into that failure, which a retry loop takes
    for one more failed try. Waited for, not awaited: a cancel of the caller
    must still land."""
    for _ in range(tries):
        if task.done():
            return True
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
    return task.done()
