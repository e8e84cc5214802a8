"""A session's queries taken one at a time, in the order they reach this process.

A plain dict of `asyncio.Lock`s cannot be pruned by asking `locked()`: a
released lock reads unlocked before the query it woke has run, so dropping it
then would let the session's next query make a new lock and run beside the
woken one. Each lock is kept as long as anyone holds or waits for it.

Across processes the work queue keeps the order, and `HandBacks` says how
long a query waits before it is offered again while an earlier one of its
session is pending elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.shared.recent import Recent


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


class HandBacks:
    """How long a query waits before it is offered again while an earlier
    query of its session is still pending elsewhere.

    The earlier one may wait out a whole ack wait for its redelivery (its
    generator died). Offered every few milliseconds meanwhile, the later
    query costs a redelivery and an ordering check each time; so the delay
    doubles, up to `cap_s`, for as long as the same earlier query blocks it,
    and starts short again once that one moved (an earlier query behind it
    now blocks, or none)."""

    def __init__(self, first_s: float, cap_s: float, size: int = 4096) -> None:
        self._first_s = first_s
        self._cap_s = cap_s
        # Per query id: the earlier query's stream sequence, and the last delay.
        self._waits: Recent[str, tuple[int, float]] = Recent(size)

    def delay(self, query_id: str, earlier_seq: int) -> float:
        blocker, last = self._waits.get(query_id) or (None, 0.0)
        delay = min(self._cap_s, last * 2) if blocker == earlier_seq else self._first_s
        self._waits.put(query_id, (earlier_seq, delay))
        return delay

    def forget(self, query_id: str) -> None:
        self._waits.pop(query_id)
