from __future__ import annotations

import pytest

from schemas.history import ChatMessage, ToolCall
from services.core.summary_prompt import (
    FIRST_REQUEST_REFERENCE,
    MINIMAL_SUMMARY,
    SECTIONS,
    SUMMARY_MARKER,
    summary_messages,
    transcript,
)

ZONE = (
    ChatMessage(role="user", content="Port parser.c to Rust"),
    ChatMessage(role="assistant", content="Reading it.",
                tool_calls=(ToolCall(name="read_file", arguments={"path": "src/parser.c"}),)),
    ChatMessage(role="tool", tool_name="read_file", content="int parse(void) {"),
    ChatMessage(role="assistant", content="error[E0382]: borrow of moved value: `buf`"),
)


def test_system_message_carries_the_marker_sections_and_rules() -> None:
    system, user = summary_messages(None, ZONE, "Port parser.c to Rust")
    assert system["role"] == "system" and user["role"] == "user"
    text = system["content"]
    assert "COMPACTION SUMMARY" in text and SUMMARY_MARKER == "COMPACTION SUMMARY"
    for section in SECTIONS:
        assert f"## {section}" in text
    lowered = text.lower()
    assert "verbatim" in lowered and "merge" in lowered
    assert "not a new conversation" in lowered
    assert "do not ask what the" in lowered


def test_user_message_holds_first_request_previous_summary_transcript_instructions() -> None:
    _, user = summary_messages("## Goal\n- earlier", ZONE, "Port parser.c to Rust",
                               "  keep the error codes  ")
    content = user["content"]
    assert content.index("Port parser.c to Rust") < content.index("## Goal\n- earlier")
    assert content.index("## Goal\n- earlier") < content.index("[user]")
    assert '(calls tool read_file with {"path":"src/parser.c"})' in content
    assert "[tool result: read_file]\nint parse(void) {" in content
    assert "error[E0382]: borrow of moved value: `buf`" in content
    assert content.rstrip().endswith("keep the error codes")


def test_without_first_request_or_previous_summary() -> None:
    system, user = summary_messages(None, ZONE[2:], None)
    assert "FIRST REQUEST" not in user["content"]
    assert "EARLIER NOTES" not in user["content"]
    assert "earlier notes" in system["content"]  # the rule to keep the quoted request


def test_empty_zone_is_refused() -> None:
    with pytest.raises(ValueError):
        summary_messages("s", (), None)


def test_transcript_labels_roles_in_order() -> None:
    labels = [line for line in transcript(ZONE).splitlines() if line.startswith("[")]
    assert labels == ["[user]", "[assistant]", "[tool result: read_file]", "[assistant]"]


def test_the_first_request_is_sent_once() -> None:
    spec = "Port parser.c to Rust. " * 300  # a pasted spec costs its size in every copy
    zone = (ChatMessage(role="user", content=spec), *ZONE[1:],
            ChatMessage(role="user", content=spec))
    _, user = summary_messages(None, zone, spec)
    assert user["content"].count(spec) == 2  # quoted, and the later message that repeats it
    assert user["content"].count(FIRST_REQUEST_REFERENCE) == 1
    assert user["content"].index("FIRST REQUEST") < user["content"].index(FIRST_REQUEST_REFERENCE)
    _, carried = summary_messages("## Goal\n- earlier", zone, None)
    assert carried["content"].count(spec) == 2 and FIRST_REQUEST_REFERENCE not in carried["content"]


def test_the_minimal_summary_has_every_section_and_nothing_in_them() -> None:
    assert [line for line in MINIMAL_SUMMARY.splitlines() if line.startswith("## ")] == [
        f"## {section}" for section in SECTIONS]
    assert set(MINIMAL_SUMMARY.splitlines()[1::2]) == {"- none"}
