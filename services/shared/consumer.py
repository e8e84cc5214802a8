"""A pull-consumer loop that keeps going through NATS outages and stops
promptly on request.

nats-py's `fetch` can turn a cancellation into its own timeout error, so a
loop that relies on cancel alone may never end: this one checks a flag.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

log = structlog.get_logger()
FETCH_TIMEOUT_S = 1.0


class PullLoop:
    def __init__(self, sub: Any, on_message: Callable[[Msg], Awaitable[None]], name: str,
                 capacity: Callable[[], int] = lambda: 64) -> None:
        self._sub = sub
        self._on_message = on_message
        self._name = name
        self._capacity = capacity
        self._stopping = asyncio.Event()
        # Set by `room_freed` so a saturated loop fetches again at once.
        self._room = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def room_freed(self) -> None:
        self._room.set()

    async def stop(self) -> None:
        self._stopping.set()
        self._room.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), FETCH_TIMEOUT_S * 3)
            except TimeoutError:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        # A pull subscription keeps unread status messages, on which a
        # connection drain would wait: let go of it explicitly.
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            batch = self._capacity()
            if batch <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                msgs = await self._sub.fetch(batch=batch, timeout=FETCH_TIMEOUT_S)
            except (NatsTimeout, TimeoutError):
                continue
            except Exception as err:  # NATS away: keep pulling, nats-py reconnects
                log.warning("fetch_failed", consumer=self._name, error=str(err))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._on_message(msg)
