"""A turn's stop switch: a model call under way ends when it is thrown, and
one not yet begun never starts."""

from __future__ import annotations

import asyncio

import pytest

from services.generator.provider import ChatResult
from services.generator.stops import (
    WITHDRAWN_FOR_S,
    StopOutcome,
    Stops,
    StopSwitch,
    Withdrawn,
)


async def answer_after(started: asyncio.Event, finish: asyncio.Event,
                       cancelled: list[bool]) -> ChatResult:
    started.set()
    try:
        await finish.wait()
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
    return ChatResult(content="whole answer")


async def test_a_call_runs_to_its_end_unless_the_switch_is_thrown() -> None:
    finish, started, cancelled = asyncio.Event(), asyncio.Event(), []
    finish.set()
    result = await StopSwitch("q1").unless_thrown(answer_after(started, finish, cancelled))
    assert result == ChatResult(content="whole answer") and not cancelled


async def test_throwing_the_switch_cancels_the_call_under_way() -> None:
    switch, started, cancelled = StopSwitch("q1"), asyncio.Event(), []
    call = asyncio.create_task(switch.unless_thrown(
        answer_after(started, asyncio.Event(), cancelled)))
    await started.wait()
    switch.throw()
    assert await call is None
    assert cancelled == [True]  # ended, not left running


async def test_a_call_after_the_switch_was_thrown_never_starts() -> None:
    switch, started = StopSwitch("q1"), asyncio.Event()
    switch.throw()
    assert await switch.unless_thrown(answer_after(started, asyncio.Event(), [])) is None
    assert not started.is_set()


async def test_a_turn_cancelled_as_a_whole_is_cancelled_not_stopped() -> None:
    """At shutdown the turn's task is cancelled: that must reach the turn
    (its query is handed back), even when a stop was asked for as well, and
    the call must have ended first."""
    for also_thrown in (False, True):
        switch, started, cancelled = StopSwitch("q1"), asyncio.Event(), []
        turn = asyncio.create_task(switch.unless_thrown(
            answer_after(started, asyncio.Event(), cancelled)))
        await started.wait()
        if also_thrown:
            switch.throw()
        turn.cancel()
        try:
            outcome = await turn
        except asyncio.CancelledError:
            outcome = "cancelled"
        assert outcome == "cancelled"
        assert cancelled == [True]


def test_a_stop_finds_only_the_turn_running_for_its_session() -> None:
    stops, switch = Stops(), StopSwitch("q1")
    assert stops.stop("s1") is None
    with stops.running("s1", switch):
        assert stops.stop("s2") is None
        assert stops.stop("s1") is StopOutcome.stopping and switch.thrown
        assert stops.stop("s1") is StopOutcome.stopping  # asked twice: the same stop
    assert stops.stop("s1") is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stop_for_a_query_held_but_not_begun_withdraws_it() -> None:
    stops = Stops()
    with stops.holding("q2"):
        assert stops.stop("s1", "q2") is StopOutcome.withdrawing
        with pytest.raises(Withdrawn), stops.running("s1", StopSwitch("q2")):
            pass
    assert stops.stop("s1") is None  # nothing registered by the withdrawn turn


def test_a_withdrawal_promised_holds_however_long_the_answer_ahead_takes() -> None:
    """Told `withdrawing`, the caller was told withdrawn: an answer ahead
    running past the duplicate window must not let the query run after all."""
    clock = Clock()
    stops = Stops(now=clock)
    with stops.holding("q2"):
        assert stops.stop("s1", "q2") is StopOutcome.withdrawing
        clock.now = 10 * WITHDRAWN_FOR_S
        with pytest.raises(Withdrawn), stops.running("s1", StopSwitch("q2")):
            pass


def test_a_stop_for_a_query_not_held_here_is_kept_for_when_it_comes() -> None:
    clock = Clock()
    stops = Stops(now=clock)
    assert stops.stop("s1", "q3") is None  # another process may hold it: no word from here
    clock.now = WITHDRAWN_FOR_S - 1
    assert stops.withdrawn("q3")
    with pytest.raises(Withdrawn), stops.running("s1", StopSwitch("q3")):
        pass
    clock.now = WITHDRAWN_FOR_S  # a resend under the same id after the window is a new try
    assert not stops.withdrawn("q3")
    with stops.running("s1", StopSwitch("q3")) as switch:
        assert not switch.thrown


def test_a_stop_once_the_answer_is_written_is_too_late() -> None:
    stops = Stops()
    with stops.holding("q1"):
        with stops.running("s1", StopSwitch("q1")):
            assert stops.stop("s1", "q1") is StopOutcome.stopping
        assert stops.stop("s1", "q1") is StopOutcome.finishing  # being stored
        assert not stops.withdrawn("q1")
    assert stops.stop("s1", "q1") is None


def test_a_stop_of_another_query_leaves_the_running_answer_alone() -> None:
    stops, switch = Stops(), StopSwitch("q1")
    with stops.holding("q1"), stops.holding("q2"), stops.running("s1", switch):
        assert stops.stop("s1", "q2") is StopOutcome.withdrawing
        assert not switch.thrown
