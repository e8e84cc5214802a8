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

import structlog

Step = Callable[[], Awaitable[None]]
Sleep = Callable[[float], Awaitable[None]]
# A step that fails is tried again after RETRY_S, doubling up to MOST_RETRY_S:
# a server that refuses for long is not asked twice a second all that while.
RETRY_S = 0.5
MOST_RETRY_S = 10.0
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
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # not `await`: a cancel of ours must land

    async def _restore(self) -> None:
        for step in self._steps:
            await self._until_done(step)
        log.info("jetstream_restored")

    async def _until_done(self, step: Step) -> None:
        delay = self._retry_s
        while True:
            try:
                await step()
                return
            except Exception as err:  # NATS away again, or still starting up
                log.warning("jetstream_restore_failed", step=getattr(step, "__qualname__", ""),
                            error=f"{type(err).__name__}: {err}", retry_in_s=delay)
            await self._sleep(delay)
            delay = min(delay * 2, max(MOST_RETRY_S, self._retry_s))
