from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, ToolCall
from schemas.messages import Level
from services.core.boundary import (
    choose_boundary,
    elide_tool_output,
    elision_marker,
    tail_turns_for,
)
from tests.core import histories


def user(text: str = "q") -> ChatMessage:
    return ChatMessage(role="user", content=text)


def answer(text: str = "a") -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def call(name: str = "run") -> ChatMessage:
    return ChatMessage(role="assistant", tool_calls=(ToolCall(name=name, arguments={"x": 1}),))


def result(text: str, name: str = "run") -> ChatMessage:
    return ChatMessage(role="tool", tool_name=name, content=text)


# u0 a1 | u2 c3 r4 c5 r6 a7 | u8 a9
HISTORY = (user(), answer(), user(), call(), result("r"), call(), result("r"), answer(),
           user(), answer())


@pytest.mark.parametrize(("tail", "want"), [(1, 8), (2, 2), (3, 0), (4, 0), (100, 0)])
def test_boundary_keeps_the_last_turns(tail: int, want: int) -> None:
    assert choose_boundary(HISTORY, tail) == want


def test_boundary_edge_cases() -> None:
    assert choose_boundary((), 1) == 0
    assert choose_boundary((user(),), 1) == 0
    # A leading fragment without a user message is compactable before the first turn.
    assert choose_boundary((answer(), user(), answer()), 1) == 1
    with pytest.raises(ValueError):
        choose_boundary(HISTORY, -1)
    # No turn kept: all of it, the last resort of a turn the last turn leaves no room.
    assert choose_boundary(HISTORY, 0) == len(HISTORY)
    assert choose_boundary((), 0) == 0


@settings(max_examples=150, deadline=None)
@given(histories(), st.integers(1, 6))
def test_boundary_properties(history: tuple[ChatMessage, ...], tail: int) -> None:
    i = choose_boundary(history, tail)
    assert 0 <= i < max(1, len(history))
    users_kept = sum(m.role == "user" for m in history[i:])
    if i == 0:
        assert sum(m.role == "user" for m in history) <= tail or history[0].role == "user"
    else:
        assert history[i].role == "user"  # never between a tool call and its result
        assert users_kept == tail
        assert history[i - 1].role != "assistant" or not history[i - 1].tool_calls


@pytest.mark.parametrize(
    ("level", "configured", "want"),
    [
        (Level.gentle, 4, 4), (Level.tighter, 4, 2), (Level.emergency, 4, 1),
        (Level.gentle, 1, 1), (Level.tighter, 1, 1), (Level.tighter, 3, 1),
        (Level.tighter, 9, 4), (Level.emergency, 9, 1),
    ],
)
def test_tail_turns_for(level: Level, configured: int, want: int) -> None:
    assert tail_turns_for(level, configured) == want


def test_tail_turns_for_rejects_zero() -> None:
    with pytest.raises(ValueError):
        tail_turns_for(Level.gentle, 0)


def test_elision_keeps_the_last_results_and_marks_the_rest() -> None:
    big = "x" * 1000
    history = (user("u" * 500), call(), result(big), answer("b" * 500), call(), result(big),
               call(), result("short"))
    out = elide_tool_output(history, keep_last=1, max_chars=100)
    assert out[2].content == "x" * 100 + elision_marker(900)
    assert out[2].content.endswith("[… 900 characters of tool output elided]")
    assert out[5].content == out[2].content
    assert out[7] == history[7]  # the last result, and short anyway
    assert out[0] == history[0] and out[3] == history[3]  # never user/assistant
    assert out[2].tool_name == "run" and out[2].role == "tool"
    assert elide_tool_output(history, keep_last=3, max_chars=100) == history
    assert elide_tool_output(history, keep_last=0, max_chars=100)[7] == history[7]


def test_elision_validation() -> None:
    with pytest.raises(ValueError):
        elide_tool_output((), keep_last=-1)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.builds(user, st.text(max_size=300)),
            st.builds(result, st.text(max_size=600)),
            st.just(call()),
        ),
        max_size=12,
    ),
    st.integers(0, 4),
    st.integers(0, 250),
)
def test_elision_properties(messages: list[ChatMessage], keep: int, max_chars: int) -> None:
    out = elide_tool_output(messages, keep, max_chars)
    assert len(out) == len(messages)
    tool_positions = [i for i, m in enumerate(messages) if m.role == "tool"]
    protected = set(tool_positions[len(tool_positions) - keep:]) if keep else set()
    for i, (before, after) in enumerate(zip(messages, out, strict=True)):
        assert after.role == before.role and after.tool_name == before.tool_name
        if before.role != "tool" or i in protected:
            assert after == before
        else:
            assert len(after.content) <= len(before.content)
            assert after.content[:max_chars] == before.content[:max_chars]
    assert elide_tool_output(out, keep, max_chars) == out  # idempotent
