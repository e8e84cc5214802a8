from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, Conversation, ToolCall
from services.core.prompt import (
    MESSAGE_OVERHEAD_CHARS,
    SUMMARY_PREFIX,
    HistoryWeights,
    history_chars,
    message_dict,
    render_messages,
    running_chars,
    sent_chars,
)
from tests.core import histories

SYSTEM = "You are terse.\n  Keep   whitespace."
SYSTEMS = st.text(max_size=30)
SUMMARIES = st.one_of(st.none(), st.text(max_size=30))
CALL = ToolCall(name="read_file", arguments={"path": "/etc/hosts", "lines": [1, 2]})
HISTORY = (
    ChatMessage(role="user", content="read it"),
    ChatMessage(role="assistant", tool_calls=(CALL,)),
    ChatMessage(role="tool", tool_name="read_file", content="127.0.0.1 localhost"),
    ChatMessage(role="assistant", content="done"),
)


def summarised(history: tuple[ChatMessage, ...], summary: str | None) -> Conversation:
    """The history after one compaction when there is a summary, else never compacted."""
    return Conversation(summary=summary, messages=history, compactions=int(summary is not None))


def test_system_first_byte_identical_then_summary_then_history_then_pending() -> None:
    conv = Conversation(summary="- goal: x", messages=HISTORY, compactions=1)
    pending = [ChatMessage(role="user", content="next")]
    out = render_messages(SYSTEM, conv, pending)
    assert out[0] == {"role": "system", "content": SYSTEM}
    assert out[1] == {"role": "system", "content": SUMMARY_PREFIX + "- goal: x"}
    assert out[2] == {"role": "user", "content": "read it"}
    assert out[3] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "read_file",
                                     "arguments": {"path": "/etc/hosts", "lines": [1, 2]}}}],
    }
    assert out[4] == {"role": "tool", "content": "127.0.0.1 localhost", "tool_name": "read_file"}
    assert out[5] == {"role": "assistant", "content": "done"}
    assert out[6] == {"role": "user", "content": "next"}
    assert len(out) == 7


def test_no_system_message_when_empty_and_no_summary_when_absent() -> None:
    out = render_messages("", Conversation(messages=HISTORY[:1]))
    assert out == [{"role": "user", "content": "read it"}]


def test_summary_prefix_frames_a_continuation_not_a_new_conversation() -> None:
    lowered = SUMMARY_PREFIX.lower()
    assert "same conversation" in lowered and "continues" in lowered
    assert "new conversation" not in lowered


def test_sent_chars_counts_content_tool_calls_tool_name_and_framing() -> None:
    msgs = render_messages(SYSTEM, Conversation(messages=HISTORY))
    calls_json = json.dumps(msgs[2]["tool_calls"], separators=(",", ":"), sort_keys=True)
    want = (
        len(SYSTEM) + len("read it") + len(calls_json) + len("127.0.0.1 localhost")
        + len("read_file") + len("done") + 5 * MESSAGE_OVERHEAD_CHARS
    )
    assert sent_chars(msgs) == want
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    tools_json = json.dumps(tools, separators=(",", ":"), sort_keys=True)
    assert sent_chars(msgs, tools) == want + len(tools_json)
    assert sent_chars([]) == 0


def test_message_dict_does_not_share_arguments() -> None:
    out = message_dict(HISTORY[1])
    out["tool_calls"][0]["function"]["arguments"]["path"] = "/changed"
    assert CALL.arguments["path"] == "/etc/hosts"


@settings(max_examples=60, deadline=None)
@given(histories(), SYSTEMS, SUMMARIES)
def test_chars_are_additive_over_messages(
    history: tuple[ChatMessage, ...], system: str, summary: str | None
) -> None:
    conv = summarised(history, summary)
    out = render_messages(system, conv)
    head = out[: len(out) - len(history)]
    assert sent_chars(out) == sent_chars(head) + history_chars(history)
    assert [m["role"] for m in out[len(head):]] == [m.role for m in history]
    if system:
        assert out[0] == {"role": "system", "content": system}


@settings(max_examples=60, deadline=None)
@given(histories())
def test_running_chars_weigh_every_prefix_of_the_history(
    history: tuple[ChatMessage, ...],
) -> None:
    running = running_chars(history)
    assert running == [history_chars(history[:i]) for i in range(len(history) + 1)]


@settings(max_examples=60, deadline=None)
@given(histories(), SYSTEMS, SUMMARIES)
def test_history_weights_match_the_rendered_prompt(
    history: tuple[ChatMessage, ...], system: str, summary: str | None
) -> None:
    conv = summarised(history, summary)
    weights = HistoryWeights.of(system, conv)
    prompt = render_messages(system, conv)
    assert weights.next_prompt == sent_chars(prompt)
    assert weights.next_prompt_messages == len(prompt)
    for boundary in range(len(history) + 1):
        before = Conversation(summary=summary, messages=history[:boundary])
        assert weights.compactable(boundary) == sent_chars(render_messages("", before))
