from __future__ import annotations

from schemas.history import ChatMessage, Conversation, ToolCall
from services.core.prompt import SUMMARY_PREFIX, message_dict, render_messages

SYSTEM = "You are terse.\n  Keep   whitespace."
CALL = ToolCall(name="read_file", arguments={"path": "/etc/hosts", "lines": [1, 2]})
HISTORY = (
    ChatMessage(role="user", content="read it"),
    ChatMessage(role="assistant", tool_calls=(CALL,)),
    ChatMessage(role="tool", tool_name="read_file", content="127.0.0.1 localhost"),
    ChatMessage(role="assistant", content="done"),
)


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


def test_message_dict_does_not_share_arguments() -> None:
    out = message_dict(HISTORY[1])
    out["tool_calls"][0]["function"]["arguments"]["path"] = "/changed"
    assert CALL.arguments["path"] == "/etc/hosts"
