"""A session's queries taken one at a time, in the order they reach this process.

A plain dict of `asyncio.Lock`s cannot be pruned by asking `locked()`: a
released lock reads unlocked before the query it woke has run, so dropping it
then would let the session's next query make a new lock and run beside the
woken one. Each lock is kept as long as anyone holds or waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ArrivalOrder:
    def __init__(self) -> None:
        # Each session's lock, and how many queries hold or wait for it.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def turn(self, sid: str) -> AsyncIterator[None]:
        """Wait for the session's earlier queries here, then hold it."""
        lock, users = self._locks.get(sid, (None, 0))
        lock = lock or asyncio.Lock()
        self._locks[sid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            _, users = self._locks[sid]
            if users == 1:
                del self._locks[sid]
            else:
                self._locks[sid] = (lock, users - 1)
