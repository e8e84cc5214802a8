"""Each session's state machine in this process, made visible.

The transition rules are the pure table in `services.core.state_machine`;
this module only keeps each session's current state and publishes every
transition on `generator.state.<session>` (the GENERATOR_STATE stream keeps
the latest one per session for the gateway). An illegal transition is logged,
reported on the error subject and raised, never ignored.
"""

from __future__ import annotations

import structlog

from schemas import subjects
from schemas.messages import ErrorReport, StateChange
from services.core.state_machine import (
    INITIAL,
    Action,
    CompactionMode,
    IllegalTransition,
    SessionState,
    transition,
)
from services.shared.bus import Bus

log = structlog.get_logger()


class SessionStates:
    def __init__(self, bus: Bus, generator_id: str, mode: CompactionMode) -> None:
        self._bus = bus
        self._generator_id = generator_id
        self._mode = mode
        self._states: dict[str, SessionState] = {}

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

    async def _announce(self, sid: str, before: SessionState, after: SessionState,
                        action: Action, correlation_id: str | None) -> None:
        # Debug, not info: the transition is published on NATS anyway, and four
        # log lines a turn cost real CPU at a few hundred turns a second.
        log.debug("state_changed", session_id=sid, from_state=before.visible.value,
                  to_state=after.visible.value, action=action.value)
        change = StateChange(session_id=sid, from_state=before.visible.value,
                             to_state=after.visible.value, action=action.value,
                             generator_id=self._generator_id)
        try:
            await self._bus.publish(subjects.state(sid), change,
                                    correlation_id=correlation_id, session_id=sid)
        except Exception as err:
            # The state has changed here either way; a turn or a compaction must
            # not stop half-way (its cleanup skipped) because watchers missed it.
            log.warning("state_publish_failed", session_id=sid, to_state=change.to_state,
                        error=f"{type(err).__name__}: {err}")
