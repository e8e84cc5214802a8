"""The per-session generator state machine.

A turn walks idle -> receiving -> generating (-> tool rounds) -> publishing ->
idle. Compaction has two modes:

- blocking: `compacting` is a phase of its own, entered only from idle; a query
  arriving meanwhile is an illegal `receive` (the shell rejects it).
- background (default): compaction is a flag beside the turn phase, so a
  session keeps answering while its summary is written.

A session's state, as the API and the page show it, is `compacting` from a
compaction's start to its result, whatever the turn phase meanwhile, and the
turn phase otherwise (`session_state`). With several generators the two come
from different places: the turn phase from the process answering the turn, the
compactions from a per-session record of those started and not yet ended
(`compaction_started`, `compaction_ended`), so no process's turn can hide
another's compaction.

Every transition not in the tables raises `IllegalTransition`; nothing is
silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType


class Phase(StrEnum):
    idle = "idle"
    receiving = "receiving"
    generating = "generating"
    dispatching_tool = "dispatching_tool"
    waiting_for_tool = "waiting_for_tool"
    publishing = "publishing"
    compacting = "compacting"
    error = "error"


class Action(StrEnum):
    receive = "receive"
    start_generation = "start_generation"
    dispatch_tool = "dispatch_tool"
    await_result = "await_result"
    tool_result = "tool_result"
    tool_timeout = "tool_timeout"
    # The answer was stopped while a tool ran: the wait ends, not by a timeout.
    stop = "stop"
    publish = "publish"
    reset = "reset"
    fail = "fail"
    start_compaction = "start_compaction"
    complete_compaction = "complete_compaction"


class CompactionMode(StrEnum):
    background = "background"
    blocking = "blocking"


@dataclass(frozen=True)
class SessionState:
    phase: Phase
    compacting: bool = False

    @property
    def visible(self) -> Phase:
        """What this process alone would show for the session."""
        return session_state(self.phase, self.compacting)


INITIAL = SessionState(Phase.idle, False)


def session_state(phase: Phase, compacting: bool) -> Phase:
    """The session's state: a running compaction is what the session is doing, a
    turn answered meanwhile included; otherwise the turn phase."""
    return Phase.compacting if compacting else phase


def compaction_started(running: Mapping[str, str], correlation_id: str,
                       generator_id: str) -> dict[str, str]:
    """The compactions running once this one has started (by its correlation id).

    Keyed by correlation id so that a request redelivered after its generator
    died is the same entry, and its result ends it."""
    return {**running, correlation_id: generator_id}


def compaction_ended(running: Mapping[str, str], correlation_id: str) -> dict[str, str]:
    """The compactions running once this one has its result; ending one that
    never started (skipped before its start) changes nothing."""
    return {cid: gen for cid, gen in running.items() if cid != correlation_id}


class IllegalTransition(Exception):
    def __init__(self, state: SessionState, action: Action, mode: CompactionMode | None = None):
        self.state = state
        self.action = action
        self.mode = mode
        flag = " (compaction in flight)" if state.compacting else ""
        where = f" in {mode.value} mode" if mode is not None else ""
        super().__init__(
            f"illegal transition: action '{action.value}' from phase "
            f"'{state.phase.value}'{flag}{where}"
        )


def _turn_table() -> dict[tuple[Phase, Action], Phase]:
    table: dict[tuple[Phase, Action], Phase] = {
        (Phase.idle, Action.receive): Phase.receiving,
        (Phase.receiving, Action.start_generation): Phase.generating,
        # A redelivered query whose answer was stored before its generator died:
        # the stored answer is the reply, with nothing to generate.
        (Phase.receiving, Action.reset): Phase.idle,
        (Phase.generating, Action.dispatch_tool): Phase.dispatching_tool,
        (Phase.dispatching_tool, Action.await_result): Phase.waiting_for_tool,
        (Phase.waiting_for_tool, Action.tool_result): Phase.generating,
        (Phase.waiting_for_tool, Action.tool_timeout): Phase.generating,
        (Phase.waiting_for_tool, Action.stop): Phase.generating,
        (Phase.generating, Action.publish): Phase.publishing,
        (Phase.publishing, Action.reset): Phase.idle,
        (Phase.error, Action.reset): Phase.idle,
    }
    # Anything underway can fail. An error that fails again stays an error, so
    # a shell's cleanup path never trips over its own failure report.
    for phase in (
        Phase.receiving,
        Phase.generating,
        Phase.dispatching_tool,
        Phase.waiting_for_tool,
        Phase.publishing,
        Phase.error,
    ):
        table[(phase, Action.fail)] = Phase.error
    return table


# The turn path, shared by both modes: (phase, action) -> next phase.
TURN_TRANSITIONS: Mapping[tuple[Phase, Action], Phase] = MappingProxyType(_turn_table())

# Blocking mode adds compaction as a phase of its own, entered only from idle.
BLOCKING_COMPACTION_TRANSITIONS: Mapping[tuple[Phase, Action], Phase] = MappingProxyType(
    {
        (Phase.idle, Action.start_compaction): Phase.compacting,
        (Phase.compacting, Action.complete_compaction): Phase.idle,
        (Phase.compacting, Action.fail): Phase.error,
    }
)


def transition(
    state: SessionState,
    action: Action,
    mode: CompactionMode = CompactionMode.background,
) -> SessionState:
    """The state after `action`, or `IllegalTransition` if the action is not allowed."""
    if mode is CompactionMode.blocking:
        return _blocking(state, action, mode)
    return _background(state, action, mode)


def _blocking(state: SessionState, action: Action, mode: CompactionMode) -> SessionState:
    # The flag belongs to background mode; a state carrying it here is corrupt.
    if state.compacting:
        raise IllegalTransition(state, action, mode)
    key = (state.phase, action)
    target = TURN_TRANSITIONS.get(key) or BLOCKING_COMPACTION_TRANSITIONS.get(key)
    if target is None:
        raise IllegalTransition(state, action, mode)
    return SessionState(target, False)


def _background(state: SessionState, action: Action, mode: CompactionMode) -> SessionState:
    # The compacting phase exists only in blocking mode.
    if state.phase is Phase.compacting:
        raise IllegalTransition(state, action, mode)
    if action is Action.start_compaction:
        if state.compacting or state.phase is Phase.error:
            raise IllegalTransition(state, action, mode)
        return SessionState(state.phase, True)
    if action is Action.complete_compaction:
        if not state.compacting:
            raise IllegalTransition(state, action, mode)
        return SessionState(state.phase, False)
    target = TURN_TRANSITIONS.get((state.phase, action))
    if target is None:
        raise IllegalTransition(state, action, mode)
    # A turn's failure or reset does not stop a compaction running beside it:
    # its own result (success or error) ends it via complete_compaction.
    return SessionState(target, state.compacting)
