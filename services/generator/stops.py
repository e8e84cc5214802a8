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
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from services.shared.recent import Recent

T = TypeVar("T")
# The stops kept for queries still to run: far more than can wait at once.
MAX_WITHDRAWN = 4096


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
    """The switches of the turns this process runs, by session."""

    def __init__(self) -> None:
        self._running: dict[str, StopSwitch] = {}
        self._withdrawn: Recent[str, bool] = Recent(MAX_WITHDRAWN)

    @contextlib.contextmanager
    def running(self, sid: str, switch: StopSwitch) -> Iterator[StopSwitch]:
        """The switch, registered for the turn; `Withdrawn` when a stop came
        for its query before. Checked and registered in one step, with no wait
        between: a stop heard meanwhile would be neither acted on nor kept."""
        if switch.query_id in self._withdrawn:
            raise Withdrawn(switch.query_id)
        self._running[sid] = switch
        try:
            yield switch
        finally:
            if self._running.get(sid) is switch:
                del self._running[sid]

    def stop(self, sid: str, query_id: str | None = None) -> StopSwitch | None:
        """Throw the session's switch (only if it is `query_id`'s, when given);
        None when no such turn runs here, and the query is then withdrawn
        should it come to run here later."""
        switch = self._running.get(sid)
        if switch is None or query_id not in (None, switch.query_id):
            if query_id is not None:
                self._withdrawn.put(query_id, True)
            return None
        switch.throw()  # thrown again: the same stop, asked twice
        return switch
