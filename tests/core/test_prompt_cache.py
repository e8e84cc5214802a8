"""The part of a call a prefix cache may have served, read off the history."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, Conversation, HistoryEntry, Snapshot
from services.core.prompt import compact_json, render_messages
from services.core.prompt_cache import cached_size, common_prefix, previous_call
from services.core.text_size import (
    MESSAGE_OVERHEAD_CHARS,
    leading_size,
    prompt_size,
    tools_size,
)
from tests.core import histories

SYSTEM = "S" * 600
TOOLS = [{"type": "function", "function": {"name": "read_file"}}]


def turn(n: int, answer_chars: int = 50) -> HistoryEntry:
    return HistoryEntry.of_turn((ChatMessage(role="user", content=f"q{n} " + "u" * 40),
                                 ChatMessage(role="assistant", content="a" * answer_chars)))


def fold(*entries: HistoryEntry) -> Conversation:
    conversation = Conversation()
    for entry in entries:
        conversation = conversation.apply(entry)
    return conversation


def question(text: str = "next") -> ChatMessage:
    return ChatMessage(role="user", content=text)


def test_the_previous_call_is_everything_stored_but_the_last_answer() -> None:
    history = fold(turn(1), turn(2))
    sent_last_turn = render_messages(SYSTEM, fold(turn(1)), [history.messages[2]])
    assert previous_call(SYSTEM, history) == sent_last_turn
    now = render_messages(SYSTEM, history, [question()])
    # The new call shares all of it: only the last answer and the question are new.
    assert cached_size(sent_last_turn, now).chars == prompt_size(sent_last_turn).chars


def test_after_a_compaction_only_the_system_prompt_can_be_cached() -> None:
    """The count after a compaction covers all but the pinned system prompt
    (Ollama still holds it): taking it for the whole prompt halved the ratio."""
    before = fold(turn(1, 9000), turn(2, 9000))
    previous = previous_call(SYSTEM, before)
    snapshot = Snapshot(summary="N" * 2000, messages=before.messages[2:], compactions=1)
    after = before.apply(HistoryEntry.of_snapshot(snapshot))
    assert after.just_compacted
    now = render_messages(SYSTEM, after, [question()])
    assert common_prefix(previous, now) == 1
    assert previous_call(SYSTEM, after) == now[:1]
    assert cached_size(previous_call(SYSTEM, after), now, TOOLS) == leading_size(now, 1, TOOLS)
    # A turn stored after the compaction was sent on the new summary.
    later = after.apply(turn(3))
    assert not later.just_compacted
    assert len(previous_call(SYSTEM, later)) == len(render_messages(SYSTEM, later)) - 1


def test_before_any_turn_nothing_is_known_to_be_cached() -> None:
    assert previous_call(SYSTEM, Conversation()) == []
    now = render_messages(SYSTEM, Conversation(), [question()])
    assert cached_size(previous_call(SYSTEM, Conversation()), now, TOOLS).chars == 0


def test_the_tools_count_as_cached_with_any_shared_prefix() -> None:
    now = render_messages(SYSTEM, Conversation(), [question()])
    cached = cached_size(now[:1], now, TOOLS)
    assert cached.chars == prompt_size(now[:1]).chars + tools_size(TOOLS).chars
    assert cached.messages == 1


@settings(max_examples=60, deadline=None)
@given(histories(), st.text(max_size=20), st.integers(0, 30))
def test_the_cached_part_is_a_prefix_of_the_call(history: tuple[ChatMessage, ...], system: str,
                                                 cut: int) -> None:
    conversation = Conversation(messages=history)
    now = render_messages(system, conversation, [question()])
    previous = [*now[:cut], {"role": "user", "content": "different"}]
    shared = common_prefix(previous, now)
    assert shared == min(cut, len(now))
    assert cached_size(previous, now) == leading_size(now, shared)
    assert cached_size(previous, now, TOOLS, prompt_size(now, TOOLS)) == leading_size(
        now, shared, TOOLS)
    assert leading_size(now, len(now), TOOLS) == prompt_size(now, TOOLS)


@settings(max_examples=60, deadline=None)
@given(histories(), st.text(max_size=20))
def test_sizes_count_characters_as_the_prompt_does(history: tuple[ChatMessage, ...],
                                                   system: str) -> None:
    prompt = render_messages(system, Conversation(messages=history), [question("é中")])
    by_hand = sum(len(m["content"]) + len(m.get("tool_name", "")) + MESSAGE_OVERHEAD_CHARS
                  + (len(compact_json(m["tool_calls"])) if "tool_calls" in m else 0)
                  for m in prompt)
    assert prompt_size(prompt, TOOLS).chars == by_hand + len(compact_json(TOOLS))
    assert prompt_size(prompt).extra_bytes >= 3
