"""Stopping an answer while it is written.

Each turn this process runs has a `StopSwitch`; a stop request for the
session throws it. A model call under way then ends at once: its task is
cancelled, which closes the HTTP stream to the model server, and the server
stops generating when its client goes away. So do the turn's other waits on
others' work: its tool calls, the summary of its emergency compaction. The
turn keeps what was written until then and stores it as its answer, marked
stopped.

A stop for a query that does not run yet (it waits behind its session's
earlier answer) is remembered by every process that hears it: whichever
comes to run that query withdraws it instead, unanswered and unstored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from enum import Enum, StrEnum
from typing import Any, TypeVar

from services.shared.jetstream import DUPLICATE_WINDOW_S
from services.shared.recent import Recent

T = TypeVar("T")
# The stops kept for queries still to run: far more than can wait at once,
# each for the QUERIES stream's duplicate window (a resend under the same id
# after it is a new try).
MAX_WITHDRAWN = 4096
WITHDRAWN_FOR_S = DUPLICATE_WINDOW_S


class StopOutcome(StrEnum):
    stopping = "stopping"  # the answer being written ends now
    withdrawing = "withdrawing"  # held here, not begun: it never will be
    finishing = "finishing"  # written already, being stored: not stopped


class Held(Enum):
    waiting = "waiting"  # for its turn
    withdrawn = "withdrawn"  # a stop came while it waited
    begun = "begun"


class Withdrawn(Exception):
    """The query was stopped before its turn began."""


class StopSwitch:
    """One turn's switch, and the text its current model call has written."""

    def __init__(self, query_id: str) -> None:
        self.query_id = query_id
        self.thrown = False
        self.written: list[str] = []
        self._call: asyncio.Future[Any] | None = None

    def throw(self) -> None:
        self.thrown = True
        if self._call is not None:
            self._call.cancel()

    async def heard(self, text: str) -> None:
        self.written.append(text)

    async def unless_thrown(self, call: Awaitable[T]) -> T | None:
        """The call's result, or None once the switch is thrown (the call then
        cancelled, and waited for, so its connection is closed)."""
        if self.thrown:
            if asyncio.iscoroutine(call):
                call.close()  # never started: nothing to cancel
            return None
        # A task of its own, so that `throw` can cancel the call and nothing
        # else; no waiter beside it (a task and a wait per model call).
        running = asyncio.ensure_future(call)
        self._call = running
        try:
            return await running
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.thrown and not (current and current.cancelling()):
                return None  # the switch, not a cancellation of the turn itself
            raise
        finally:
            self._call = None


class Stops:
    """The switches of the turns this process runs, by session, and the
    queries it holds: taken from the queue, and waiting for their turn or
    being finished."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._running: dict[str, StopSwitch] = {}
        self._held: dict[str, Held] = {}
        # The stops heard for queries not held here, and when.
        self._withdrawn: Recent[str, float] = Recent(MAX_WITHDRAWN)
        self._now = now

    @contextlib.contextmanager
    def holding(self, query_id: str) -> Iterator[None]:
        self._held[query_id] = Held.waiting
        try:
            yield
        finally:
            self._held.pop(query_id, None)

    @contextlib.contextmanager
    def running(self, sid: str, switch: StopSwitch) -> Iterator[StopSwitch]:
        """The switch, registered for the turn; `Withdrawn` when a stop came
        for its query before. Checked and registered in one step, with no wait
        between: a stop heard meanwhile would be neither acted on nor kept."""
        if self.withdrawn(switch.query_id):
            raise Withdrawn(switch.query_id)
        if switch.query_id in self._held:
            self._held[switch.query_id] = Held.begun
        self._running[sid] = switch
        try:
            yield switch
        finally:
            if self._running.get(sid) is switch:
                del self._running[sid]

    def running_query(self, sid: str) -> str | None:
        switch = self._running.get(sid)
        return switch.query_id if switch is not None else None

    def withdrawn(self, query_id: str) -> bool:
        """Whether a stop came for the query before it began: for as long as
        it is held here (a withdrawal promised holds however long the answer
        ahead of it takes), else for the duplicate window."""
        if self._held.get(query_id) is Held.withdrawn:
            return True
        heard = self._withdrawn.get(query_id)
        return heard is not None and self._now() - heard < WITHDRAWN_FOR_S

    def stop(self, sid: str, query_id: str | None = None) -> StopOutcome | None:
        """Throw the session's switch (only if it is `query_id`'s, when given).
        A named query that has not begun is withdrawn when it comes to run
        here; None when this process does not hold it (nor runs the session's
        answer, unnamed)."""
        switch = self._running.get(sid)
        if switch is not None and query_id in (None, switch.query_id):
            switch.throw()  # thrown again: the same stop, asked twice
            return StopOutcome.stopping
        if query_id is None:
            return None
        held = self._held.get(query_id)
        if held is Held.begun:
            return StopOutcome.finishing  # its answer is being stored: too late
        self._withdrawn.put(query_id, self._now())
        if held is None:
            return None
        self._held[query_id] = Held.withdrawn
        return StopOutcome.withdrawing
