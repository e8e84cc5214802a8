"""Each session's state machine in this process, made visible.

The transition rules are the pure table in `services.core.state_machine`;
this module only keeps each session's current state and publishes every change
of its turn phase on `generator.state.<session>` (the GENERATOR_STATE stream
keeps the latest one per session for the gateway). An illegal transition is
logged, reported on the error subject and raised, never ignored.

A background compaction is not a turn phase, and another process may answer the
session's turns meanwhile: it is recorded in the session's entry of the
`compactions_running` bucket instead, added before its start is announced and
removed before its result is, so whoever sees either event reads a record that
agrees with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping

import structlog
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas import subjects
from schemas.messages import ErrorReport, StateChange
from schemas.session import CompactionsRunning
from services.core.failed_tries import Failure, Tries, TryAgain, after_failure
from services.core.state_machine import (
    INITIAL,
    Action,
    CompactionMode,
    IllegalTransition,
    SessionState,
    compaction_ended,
    compaction_started,
    transition,
)
from services.shared.bus import Bus

log = structlog.get_logger()

# Only compactions of the same session, at the same moment, contend for its entry.
RECORD_ATTEMPTS = 5
Change = Callable[[Mapping[str, str]], dict[str, str]]


class RecordNotTaken(Exception):
    """NATS did not take a write to the `compactions_running` bucket."""


class SessionStates:
    def __init__(self, bus: Bus, generator_id: str, mode: CompactionMode) -> None:
        self._bus = bus
        self._generator_id = generator_id
        self._mode = mode
        self._states: dict[str, SessionState] = {}
        self._running: KeyValue | None = None
        # Compactions over whose end NATS did not take: left in the bucket,
        # the session would read compacting until someone deleted it.
        self._owed_ends: set[tuple[str, str]] = set()
        self._started_while_owed: set[tuple[str, str]] = set()
        self._settling: asyncio.Task[None] | None = None
        # The compactions running here, by session and correlation id.
        self._compacting: set[tuple[str, str]] = set()

    def current(self, sid: str) -> SessionState:
        return self._states.get(sid, INITIAL)

    def busy_sessions(self) -> int:
        return sum(1 for s in self._states.values() if s != INITIAL)

    async def apply(self, sid: str, action: Action, correlation_id: str | None = None) -> None:
        before = self.current(sid)
        try:
            after = transition(before, action, self._mode)
        except IllegalTransition as err:
            log.error("illegal_transition", session_id=sid, state=before.visible.value,
                      action=action.value)
            await self._bus.publish(
                subjects.ERROR_SUBJECT,
                ErrorReport(code="illegal_transition", message=str(err),
                            subject=subjects.state(sid)),
                correlation_id=correlation_id, session_id=sid,
            )
            raise
        if after == INITIAL:
            self._states.pop(sid, None)
        else:
            self._states[sid] = after
        await self._announce(sid, before, after, action, correlation_id)

    async def recover(self, sid: str, correlation_id: str | None = None) -> None:
        """Whatever went wrong, leave the session idle for its next query."""
        state = self.current(sid)
        if state.phase.value == "idle":
            return
        if state.phase.value != "error":
            await self.apply(sid, Action.fail, correlation_id)
        await self.apply(sid, Action.reset, correlation_id)

    async def compaction_started(self, sid: str, correlation_id: str) -> None:
        # An earlier compaction's end under this id, still owed, would end this
        # one: it is owed no more, and if it lands all the same (it was on its
        # way), this start is written again after it.
        if (sid, correlation_id) in self._owed_ends:
            self._owed_ends.discard((sid, correlation_id))
            self._started_while_owed.add((sid, correlation_id))
        self._compacting.add((sid, correlation_id))
        await self._record(sid, correlation_id, self._starting(correlation_id))

    async def compaction_ended(self, sid: str, correlation_id: str) -> None:
        """Recorded now if NATS takes it, else tried again in the background
        until it does: the result is not held back meanwhile."""
        self._compacting.discard((sid, correlation_id))
        if not await self._record(sid, correlation_id, _ending(correlation_id)):
            self._owed_ends.add((sid, correlation_id))
            if self._settling is None or self._settling.done():
                self._settling = asyncio.create_task(self._settle_owed_ends())

    async def record_running_again(self) -> None:
        """NATS came back: its bucket, kept in memory, may have come back
        empty, and the sessions compacting here would read idle until their
        compactions ended."""
        self._running = None  # the bucket made again: not the handle to the old one
        for sid, correlation_id in sorted(self._compacting):
            if (sid, correlation_id) not in self._compacting:
                continue  # ended meanwhile
            if not await self._record(sid, correlation_id, self._starting(correlation_id)):
                raise RecordNotTaken(sid)  # the reconnect's steps are tried again
            if (sid, correlation_id) not in self._compacting:
                # Its end, while this start was written, may have found nothing to remove.
                await self.compaction_ended(sid, correlation_id)

    async def stop(self) -> None:
        if self._settling is not None:
            self._settling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._settling

    async def _settle_owed_ends(self) -> None:
        """Tried again after the pauses of any try while NATS does not answer
        (`services.core.failed_tries`), with no end to the patience."""
        tries = Tries()
        while self._owed_ends:
            tries, outcome = after_failure(tries, Failure.nats_away, time.monotonic(), math.inf)
            if isinstance(outcome, TryAgain):
                await asyncio.sleep(outcome.after_s)
            for pair in sorted(self._owed_ends):
                if pair in self._owed_ends:  # else started anew: that one ends by itself
                    await self._settle(*pair)
            self._started_while_owed.clear()

    async def _settle(self, sid: str, correlation_id: str) -> None:
        if not await self._record(sid, correlation_id, _ending(correlation_id)):
            return
        self._owed_ends.discard((sid, correlation_id))
        log.info("compaction_end_recorded_late", session_id=sid, correlation_id=correlation_id)
        if (sid, correlation_id) in self._started_while_owed:
            await self._record(sid, correlation_id, self._starting(correlation_id))

    def _starting(self, correlation_id: str) -> Change:
        return lambda running: compaction_started(running, correlation_id, self._generator_id)

    async def compaction_recorded(self, sid: str, correlation_id: str) -> bool:
        """Whether the session's entry holds a compaction under this id."""
        try:
            entry = await (await self._bucket()).get(sid)
        except KeyNotFoundError:
            return False
        running = CompactionsRunning.model_validate_json(entry.value or b"{}").running
        return correlation_id in running

    async def _record(self, sid: str, correlation_id: str, change: Change) -> bool:
        """Whether the change was recorded. A failure is logged, never raised:
        as a state publish, watchers may miss it, the compaction goes on."""
        try:
            for _ in range(RECORD_ATTEMPTS):
                if await self._try_record(sid, change):
                    return True
            log.warning("compaction_record_contended", session_id=sid,
                        correlation_id=correlation_id)
        except Exception as err:
            log.warning("compaction_record_failed", session_id=sid,
                        correlation_id=correlation_id, error=f"{type(err).__name__}: {err}")
        return False

    async def _try_record(self, sid: str, change: Change) -> bool:
        """One compare-and-swap of the session's entry; False if another got there first."""
        bucket = await self._bucket()
        try:
            entry = await bucket.get(sid)
        except KeyNotFoundError:
            running, revision = CompactionsRunning(), None
        else:
            running = CompactionsRunning.model_validate_json(entry.value or b"{}")
            revision = entry.revision
        updated = CompactionsRunning(running=change(running.running))
        if updated == running:
            return True
        value = updated.model_dump_json().encode()
        try:
            if revision is None:
                await bucket.create(sid, value)
            else:
                await bucket.update(sid, value, last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _bucket(self) -> KeyValue:
        if self._running is None:
            self._running = await self._bus.js.key_value(subjects.COMPACTIONS_RUNNING_BUCKET)
        return self._running

    async def _announce(self, sid: str, before: SessionState, after: SessionState,
                        action: Action, correlation_id: str | None) -> None:
        if before.phase is after.phase:
            return  # a background compaction's flag: recorded by compaction_started/ended
        # Debug, not info: the transition is published on NATS anyway, and four
        # log lines a turn cost real CPU at a few hundred turns a second.
        log.debug("state_changed", session_id=sid, from_state=before.phase.value,
                  to_state=after.phase.value, action=action.value)
        change = StateChange(session_id=sid, from_state=before.phase.value,
                             to_state=after.phase.value, action=action.value,
                             generator_id=self._generator_id)
        try:
            await self._bus.publish(subjects.state(sid), change,
                                    correlation_id=correlation_id, session_id=sid)
        except Exception as err:
            # The state has changed here either way; a turn or a compaction must
            # not stop half-way (its cleanup skipped) because watchers missed it.
            log.warning("state_publish_failed", session_id=sid, to_state=change.to_state,
                        error=f"{type(err).__name__}: {err}")


def _ending(correlation_id: str) -> Change:
    return lambda running: compaction_ended(running, correlation_id)
