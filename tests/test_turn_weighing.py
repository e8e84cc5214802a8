"""What a turn reports of its last model call: its size, as weighed when it
was fitted, and the part a prompt cache may have served, weighed after the
reply against the call before it (the session's previous call for a turn's
first)."""

from __future__ import annotations

from schemas.envelope import Envelope
from schemas.history import ChatMessage, Conversation, ToolCall
from schemas.messages import Query
from schemas.session import SessionRecord
from services.core.prompt import render_messages
from services.core.prompt_cache import cached_size, previous_call
from services.core.text_size import prompt_size
from services.generator.turn import Turn, WeighedPrompt
from services.shared.history_store import HistoryView

SYSTEM = "You are terse."
HISTORY = Conversation(messages=[
    ChatMessage(role="user", content="first question"),
    ChatMessage(role="assistant", content="first answer"),
])
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {}}}]


def a_turn() -> Turn:
    env = Envelope[Query](message_type="chat.query", subject="chat.query.s1",
                          sender_id="gateway", session_id="s1",
                          payload=Query(session_id="s1", content="second question"))
    record = SessionRecord(session_id="s1", system=SYSTEM, tokens_per_char=0.25)
    question = ChatMessage(role="user", content="second question", query_id=env.message_id)
    return Turn(env, record, HistoryView(HISTORY, last_seq=2), [question])


def test_a_turns_only_call_is_read_against_the_sessions_previous_call() -> None:
    turn = a_turn()
    prompt = render_messages(SYSTEM, HISTORY, turn.messages)
    turn.called(WeighedPrompt.of(prompt, TOOLS))
    turn.weigh_cached_part(TOOLS)
    before = previous_call(SYSTEM, HISTORY, called_before=True)
    assert turn.sent == prompt_size(prompt, TOOLS)
    assert turn.reused == cached_size(before, prompt, TOOLS)
    assert turn.reused.messages == len(before) > 0


def test_after_a_tool_round_the_last_call_is_read_against_the_round_before() -> None:
    turn = a_turn()
    first = render_messages(SYSTEM, HISTORY, turn.messages)
    turn.called(WeighedPrompt.of(first, TOOLS))
    turn.messages = [*turn.messages,
                     ChatMessage(role="assistant", content="",
                                 tool_calls=[ToolCall(name="clock")]),
                     ChatMessage(role="tool", content="12:00")]
    second = render_messages(SYSTEM, HISTORY, turn.messages)
    turn.called(WeighedPrompt.of(second, TOOLS))
    turn.weigh_cached_part(TOOLS)
    assert turn.sent == prompt_size(second, TOOLS)
    assert turn.reused == cached_size(first, second, TOOLS)
    assert turn.reused.messages == len(first)


def test_the_history_the_turn_began_on_is_kept_as_the_turn_is_stored() -> None:
    turn = a_turn()
    prompt = render_messages(SYSTEM, HISTORY, turn.messages)
    turn.called(WeighedPrompt.of(prompt, []))
    turn.view = HistoryView(Conversation(messages=[*HISTORY.messages, *turn.messages]), 3)
    turn.weigh_cached_part([])
    assert turn.reused == cached_size(previous_call(SYSTEM, HISTORY, True), prompt)
