"""The transcript's items, cursors and Markdown, as pure functions (its search: `recall`)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.history import ChatMessage, HistoryEntry, Snapshot, ToolCall
from services.core.recall import Recall, recall
from services.core.transcript import (
    InvalidCursor,
    MarkdownWriter,
    Position,
    StoredEntry,
    divider,
    items_after,
    markdown,
    page_limit,
)
from services.core.transcript import _markdown_item as markdown_lines

AT = datetime(2026, 1, 2, 14, 2, tzinfo=UTC)


def turn(i: int) -> HistoryEntry:
    return HistoryEntry.of_turn((ChatMessage(role="user", content=f"question {i}"),
                                 ChatMessage(role="assistant", content=f"answer {i}")))


def entries() -> list[StoredEntry]:
    snapshot = Snapshot(summary="notes", messages=turn(2).messages, compactions=1, at=AT,
                        auto=True, level="gentle", tokens_before=1255, tokens_after=1002)
    return [StoredEntry(1, AT, turn(1)), StoredEntry(2, AT, turn(2)),
            StoredEntry(3, AT, HistoryEntry.of_snapshot(snapshot)), StoredEntry(4, AT, turn(3))]


def test_a_snapshot_is_one_marker_and_its_kept_copies_are_not_repeated() -> None:
    items = list(items_after(entries(), None))
    assert [i.kind for i in items] == ["message"] * 4 + ["compaction"] + ["message"] * 2
    marker = items[4].as_json()
    assert marker == {"kind": "compaction", "at": AT.isoformat(), "auto": True,
                      "level": "gentle", "tokens_before": 1255, "tokens_after": 1002,
                      "summary": "notes", "compactions": 1, "kept_messages": 2,
                      "position": "3-0"}
    assert [str(i.position) for i in items] == ["1-0", "1-1", "2-0", "2-1", "3-0", "4-0", "4-1"]


def test_a_stopped_answer_and_a_retry_say_so() -> None:
    question = ChatMessage(role="user", content="q", query_id="q1")
    stopped = ChatMessage(role="assistant", content="par", query_id="q1", stopped=True)
    fresh = ChatMessage(role="assistant", content="full", query_id="q2")
    stored = [StoredEntry(1, AT, HistoryEntry.of_turn((question, stopped))),
              StoredEntry(2, AT, HistoryEntry.of_turn((fresh,), supersedes="q1"))]
    items = [i.as_json() for i in items_after(stored, None)]
    assert items[1] == {"kind": "message", "role": "assistant", "content": "par",
                        "query_id": "q1", "stopped": True, "position": "1-1"}
    assert items[2] == {"kind": "message", "role": "assistant", "content": "full",
                        "query_id": "q2", "supersedes": "q1", "position": "2-0"}
    assert "stopped" not in items[0] and "supersedes" not in items[0]


def test_an_answer_carries_the_counts_of_the_call_that_wrote_it() -> None:
    question = ChatMessage(role="user", content="q", query_id="q1")
    answer = ChatMessage(role="assistant", content="a", query_id="q1", prompt_tokens=120,
                         completion_tokens=7)
    items = [i.as_json() for i in items_after(
        [StoredEntry(1, AT, HistoryEntry.of_turn((question, answer)))], None)]
    assert items[1] == {"kind": "message", "role": "assistant", "content": "a",
                        "query_id": "q1", "prompt_tokens": 120, "completion_tokens": 7,
                        "position": "1-1"}
    assert "prompt_tokens" not in items[0]


def test_items_after_a_cursor_start_right_after_it() -> None:
    whole = list(items_after(entries(), None))
    for n, item in enumerate(whole):
        assert list(items_after(entries(), item.position)) == whole[n + 1:]


def test_cursors_and_limits_are_checked() -> None:
    assert Position.parse("12-3") == Position(12, 3)
    huge = "9" * 5000  # past the 4,300 digits Python's int() takes
    for bad in ("", "12", "a-1", "1-", "-1", "1-2-3", "١-٢", f"{huge}-0", f"1-{huge}",
                f"{2**63}-0"):
        with pytest.raises(InvalidCursor):
            Position.parse(bad)
    assert page_limit(None) == 200 and page_limit("1000") == 1000
    for bad in ("0", "1001", "x", "-5", "2.5", huge):
        with pytest.raises(ValueError):
            page_limit(bad)


def test_markdown_shows_each_compaction_as_a_divider() -> None:
    text = markdown("s1", items_after(entries(), None))
    assert text.index("question 1") < text.index("notes") < text.index("question 3")
    assert "compacted · automatic · 1,255 → 1,002 tokens · 2026-01-02 14:02 UTC" in text
    assert divider({"kind": "compaction", "auto": False, "level": "emergency",
                    "at": None}) == "compacted · manual · emergency"


@pytest.mark.parametrize("last", ["answer", "ends in spaces   ", "two blank lines\n\n", " "])
def test_markdown_written_piece_by_piece_is_the_whole_document(last: str) -> None:
    stored = [*entries(), StoredEntry(5, AT, HistoryEntry.of_turn((
        ChatMessage(role="user", content="  lead and trail  "),
        ChatMessage(role="assistant", content=last))))]
    items = list(items_after(stored, None))
    # The document as one string: its head, every item's lines, no trailing blank.
    lines = ["# Session s1", "", *(line for item in items for line in markdown_lines(item.body))]
    whole = "\n".join(lines).rstrip() + "\n"
    writer = MarkdownWriter("s1")
    pieces = [writer.head(), *(writer.item(item) for item in items), writer.end()]
    assert "".join(pieces) == whole == markdown("s1", items)


def test_recall_matches_every_word_case_insensitively_newest_first() -> None:
    messages = (ChatMessage(role="user", content="The locker code is 4711"),
                ChatMessage(role="assistant", content="", tool_calls=(
                    ToolCall(name="note", arguments={"text": "locker CODE"}),)),
                ChatMessage(role="user", content="locker only"))
    stored = [StoredEntry(1, AT, HistoryEntry.of_turn(messages)), *entries()]
    found = recall(items_after(stored, None), "Locker code", 5)
    assert [str(i.position) for i in found] == ["1-1", "1-0"]
    assert recall(items_after(stored, None), "locker code", 1)[0].position == Position(1, 1)
    assert recall(items_after(stored, None), "  ", 5) == []
    assert recall(items_after(stored, None), "notes", 5) == []  # markers are not messages


def test_recall_finds_words_of_scripts_written_without_spaces() -> None:
    """A Chinese clause was one `\\w+` word: only the whole clause matched."""
    said = ChatMessage(role="user", content="预算会议在三月十四日，在4B会议室。")
    stored = [StoredEntry(1, AT, HistoryEntry.of_turn((said,)))]
    for query in ("会议", "预算会议", "三月 4B", "会议室"):
        assert len(recall(items_after(stored, None), query, 5)) == 1, query
    assert recall(items_after(stored, None), "四月", 5) == []
    for clause, word in (("ເມືອງຫຼວງພະບາງງາມຫຼາຍ", "ຫຼວງພະບາງ"), ("ខេត្តសៀមរាបស្អាត", "សៀមរាប"),
                         ("ｺﾚﾊﾃｽﾄﾃﾞｽ", "ﾃｽﾄ")):
        elsewhere = [StoredEntry(1, AT, HistoryEntry.of_turn((
            ChatMessage(role="user", content=clause),)))]
        assert len(recall(items_after(elsewhere, None), word, 5)) == 1, word


def test_recall_never_finds_its_own_calls_and_results() -> None:
    """Each recall's call and result hold the query; newest, they crowded out
    the message that was asked about."""
    said = ChatMessage(role="user", content="the budget meeting is on March 14")
    searched = (ChatMessage(role="user", content="when is it?"),
                ChatMessage(role="assistant", content="", tool_calls=(
                    ToolCall(name="recall", arguments={"query": "budget meeting"}),)),
                ChatMessage(role="tool", tool_name="recall",
                            content='{"matches": [{"content": "the budget meeting"}]}'))
    stored = [StoredEntry(1, AT, HistoryEntry.of_turn((said,))),
              StoredEntry(2, AT, HistoryEntry.of_turn(searched))]
    found = recall(items_after(stored, None), "budget meeting", 5, own_tool="recall")
    assert [i.body["content"] for i in found] == [said.content]


def test_recall_fed_an_entry_at_a_time_finds_what_it_finds_whole() -> None:
    stored = [StoredEntry(n, AT, HistoryEntry.of_turn((
        ChatMessage(role="user", content=f"the code is {n}"),
        ChatMessage(role="assistant", content="noted")))) for n in range(1, 41)]
    items = list(items_after(stored, None))
    for limit in (0, 1, 3, 40, 100):
        search = Recall("CODE", limit)
        for entry in stored:
            search.take(items_after([entry], None))
        assert search.found() == recall(items, "CODE", limit)
        assert [i.body["content"] for i in search.found()][:2] == [
            f"the code is {n}" for n in (40, 39)][:limit]
