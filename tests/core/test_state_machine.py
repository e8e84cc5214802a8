"""Every (state, action, mode) against an independently written expectation."""

from __future__ import annotations

import itertools

import pytest

from services.core.state_machine import (
    INITIAL,
    TURN_TRANSITIONS,
    Action,
    CompactionMode,
    IllegalTransition,
    Phase,
    SessionState,
    compaction_ended,
    compaction_started,
    session_state,
    transition,
)

P, A = Phase, Action
ALL_STATES = [SessionState(p, c) for p in Phase for c in (False, True)]
ALL = list(itertools.product(ALL_STATES, Action, CompactionMode))

# The turn path, spelled out as the brief states it (not copied from the module).
TURN_STEPS = {
    P.idle: {A.receive: P.receiving},
    P.receiving: {A.start_generation: P.generating, A.reset: P.idle},
    P.generating: {A.dispatch_tool: P.dispatching_tool, A.publish: P.publishing},
    P.dispatching_tool: {A.await_result: P.waiting_for_tool},
    P.waiting_for_tool: {A.tool_result: P.generating, A.tool_timeout: P.generating,
                         A.stop: P.generating},
    P.publishing: {A.reset: P.idle},
    P.error: {A.reset: P.idle},
}


def expected(state: SessionState, action: Action, mode: CompactionMode) -> SessionState | None:
    """None means illegal."""
    phase, flag = state.phase, state.compacting
    if mode is CompactionMode.blocking:
        if flag:
            return None  # the flag does not exist in blocking mode
        if phase is P.idle and action is A.start_compaction:
            return SessionState(P.compacting)
        if phase is P.compacting:
            if action is A.complete_compaction:
                return SessionState(P.idle)
            return SessionState(P.error) if action is A.fail else None
    else:
        if phase is P.compacting:
            return None  # a phase only blocking mode uses
        if action is A.start_compaction:
            return None if flag or phase is P.error else SessionState(phase, True)
        if action is A.complete_compaction:
            return SessionState(phase, False) if flag else None
    if action is A.fail:
        return None if phase is P.idle else SessionState(P.error, flag)
    nxt = TURN_STEPS.get(phase, {}).get(action)
    return None if nxt is None else SessionState(nxt, flag)


@pytest.mark.parametrize(("state", "action", "mode"), ALL)
def test_every_combination(state: SessionState, action: Action, mode: CompactionMode) -> None:
    want = expected(state, action, mode)
    if want is None:
        with pytest.raises(IllegalTransition) as err:
            transition(state, action, mode)
        assert err.value.state == state and err.value.action is action
        assert action.value in str(err.value) and state.phase.value in str(err.value)
    else:
        assert transition(state, action, mode) == want


def test_combination_count_is_exhaustive() -> None:
    assert len(ALL) == 8 * 2 * 12 * 2


def test_default_mode_is_background() -> None:
    assert transition(INITIAL, A.start_compaction) == SessionState(P.idle, True)


def test_turn_table_is_one_dict() -> None:
    assert (P.idle, A.receive) in TURN_TRANSITIONS
    assert all(isinstance(k, tuple) and len(k) == 2 for k in TURN_TRANSITIONS)


def reachable(mode: CompactionMode) -> set[SessionState]:
    seen, frontier = {INITIAL}, [INITIAL]
    while frontier:
        state = frontier.pop()
        for action in Action:
            try:
                nxt = transition(state, action, mode)
            except IllegalTransition:
                continue
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen


def test_reachable_states() -> None:
    assert reachable(CompactionMode.blocking) == {SessionState(p) for p in Phase}
    assert reachable(CompactionMode.background) == {
        SessionState(p, c) for p in Phase if p is not P.compacting for c in (False, True)
    }


@pytest.mark.parametrize("mode", list(CompactionMode))
def test_error_always_recovers_to_idle(mode: CompactionMode) -> None:
    """From every reachable state but idle, fail then reset gives an idle turn phase."""
    for state in reachable(mode):
        if state.phase is P.idle:
            with pytest.raises(IllegalTransition):
                transition(state, A.fail, mode)
            continue
        failed = transition(state, A.fail, mode)
        assert failed.phase is P.error
        recovered = transition(failed, A.reset, mode)
        assert recovered.phase is P.idle
        # A turn's failure leaves a background compaction running beside it.
        assert recovered.compacting == state.compacting


@pytest.mark.parametrize(
    ("state", "visible"),
    [
        (SessionState(P.idle, False), P.idle),
        (SessionState(P.idle, True), P.compacting),
        (SessionState(P.generating, True), P.compacting),
        (SessionState(P.error, True), P.compacting),
        (SessionState(P.generating, False), P.generating),
        (SessionState(P.compacting, False), P.compacting),
    ],
)
def test_visible_state(state: SessionState, visible: Phase) -> None:
    assert state.visible is visible


def test_a_running_compaction_is_the_sessions_state_whatever_the_turn_does() -> None:
    for phase in Phase:
        assert session_state(phase, True) is P.compacting
        assert session_state(phase, False) is phase


def test_compactions_running_follow_their_start_and_their_result() -> None:
    running = compaction_started({}, "c1", "gen-a")
    running = compaction_started(running, "c2", "gen-b")  # another generator, same session
    assert running == {"c1": "gen-a", "c2": "gen-b"}
    # A result ends its own compaction only: the other one still runs.
    assert compaction_ended(running, "c1") == {"c2": "gen-b"}
    # A result with no start (a request skipped before it began) changes nothing.
    assert compaction_ended(running, "c9") == running
    # A redelivered request (its generator died) is the same entry, taken over.
    assert compaction_started(running, "c1", "gen-b") == {"c1": "gen-b", "c2": "gen-b"}
    assert compaction_ended(compaction_ended(running, "c2"), "c1") == {}


def test_full_turn_with_tools_and_background_compaction() -> None:
    mode = CompactionMode.background
    state = INITIAL
    for action in (
        A.receive, A.start_compaction, A.start_generation, A.dispatch_tool, A.await_result,
        A.tool_timeout, A.dispatch_tool, A.await_result, A.tool_result, A.publish,
    ):
        state = transition(state, action, mode)
    assert state == SessionState(P.publishing, True)
    state = transition(state, A.reset, mode)
    assert state.visible is P.compacting
    assert transition(state, A.complete_compaction, mode) == INITIAL


def test_blocking_rejects_a_query_and_stays_compacting() -> None:
    mode = CompactionMode.blocking
    state = transition(INITIAL, A.start_compaction, mode)
    with pytest.raises(IllegalTransition):
        transition(state, A.receive, mode)
    assert state.visible is P.compacting
    assert transition(state, A.complete_compaction, mode) == INITIAL


def test_states_are_values_with_string_enums() -> None:
    assert SessionState(P.idle) == INITIAL
    assert P("waiting_for_tool") is P.waiting_for_tool
    assert A("complete_compaction") is A.complete_compaction
    assert CompactionMode("blocking") is CompactionMode.blocking
