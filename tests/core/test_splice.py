from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, Conversation, HistoryEntry, Role, ToolCall, fold
from services.core.splice import (
    CompactionPlan,
    SpliceConflict,
    compacted_query_ids,
    first_user_request,
    plan_compaction,
    splice,
    splice_elided,
)
from tests.core import histories, turns


def msg(role: Role, text: str) -> ChatMessage:
    return ChatMessage(role=role, content=text)


TURNS = tuple(
    m for i in range(4) for m in (msg("user", f"u{i}"), msg("assistant", f"a{i}"))
)
SNAP = Conversation(messages=TURNS)


def test_plan_and_splice_keep_the_live_zone_and_new_messages() -> None:
    plan = plan_compaction(SNAP, tail_turns=2)
    assert plan is not None and plan.boundary == 4
    assert plan.to_compact == TURNS[:4] and plan.live == TURNS[4:]
    appended = (msg("user", "u4"), msg("assistant", "a4"))
    current = SNAP.model_copy(update={"messages": TURNS + appended})
    out = splice(current, plan, "notes")
    assert out.summary == "notes"
    assert out.messages == TURNS[4:] + appended
    assert out.compactions == 1
    # What the rollup looks like after folding the history stream.
    folded = fold([HistoryEntry.of_message(m) for m in TURNS]
                  + [HistoryEntry.of_snapshot(out)])
    assert folded == Conversation(summary="notes", messages=out.messages, compactions=1,
                                  just_compacted=True)


def test_nothing_to_compact() -> None:
    assert plan_compaction(SNAP, tail_turns=4) is None
    assert plan_compaction(Conversation(), tail_turns=1) is None


def test_plan_validates_its_boundary() -> None:
    with pytest.raises(ValueError):
        CompactionPlan(SNAP, 0)
    with pytest.raises(ValueError):
        CompactionPlan(SNAP, len(TURNS) + 1)


@pytest.mark.parametrize("summary", ["", "   ", "\n\t"])
def test_blank_summary_is_never_spliced(summary: str) -> None:
    plan = plan_compaction(SNAP, 1)
    assert plan is not None
    with pytest.raises(ValueError):
        splice(SNAP, plan, summary)


def test_conflicts() -> None:
    plan = plan_compaction(SNAP, 1)
    assert plan is not None
    rolled = Conversation(summary="other", messages=TURNS[6:], compactions=1)
    changed = SNAP.model_copy(update={"messages": (msg("user", "edited"), *TURNS[1:])})
    shorter = SNAP.model_copy(update={"messages": TURNS[: plan.boundary - 1]})
    recount = SNAP.model_copy(update={"compactions": 3})
    for current in (rolled, changed, shorter, recount):
        with pytest.raises(SpliceConflict):
            splice(current, plan, "notes")


def test_a_retry_in_the_live_zone_meanwhile_is_spliced_not_refused() -> None:
    # Asked again while the summary was written: the live zone's last answer
    # is replaced; the compact zone is as it was, so the summary still fits.
    answered = tuple(m.model_copy(update={"query_id": f"q{i // 2}"})
                     for i, m in enumerate(TURNS))
    snapshot = Conversation(messages=answered)
    plan = plan_compaction(snapshot, tail_turns=1)
    assert plan is not None
    fresh = ChatMessage(role="assistant", content="a3, again", query_id="r1")
    current = snapshot.apply(HistoryEntry.of_turn((fresh,), supersedes="q3"))
    out = splice(current, plan, "notes")
    assert out.messages == (answered[6], fresh)
    # The replaced answer's query stays known as answered after the splice.
    assert "q3" in out.compacted_query_ids


def test_second_compaction_stacks_on_the_first() -> None:
    first = plan_compaction(SNAP, 2)
    assert first is not None
    after = splice(SNAP, first, "notes 1")
    conv = Conversation(summary=after.summary, messages=after.messages, compactions=1)
    second = plan_compaction(conv, 1)
    assert second is not None
    out = splice(conv, second, "notes 1+2")
    assert out.compactions == 2 and out.messages == TURNS[6:]


def test_first_user_request() -> None:
    assert first_user_request(SNAP) == "u0"
    assert first_user_request(Conversation(messages=(msg("assistant", "hi"),))) is None
    assert first_user_request(Conversation(summary="s", messages=TURNS, compactions=1)) is None
    # Only tool output cut: no summary yet to carry the request.
    plan = plan_compaction(SNAP, tail_turns=2)
    assert plan is not None
    elided = splice_elided(SNAP, plan)
    assert elided.summary is None and elided.compactions == 1
    assert first_user_request(Conversation(messages=elided.messages,
                                           compactions=elided.compactions)) == "u0"


@settings(max_examples=120, deadline=None)
@given(histories(), st.lists(turns(), max_size=3), st.integers(1, 4))
def test_splice_keeps_every_message_after_the_boundary(
    history: tuple[ChatMessage, ...], later: list[list[ChatMessage]], tail: int
) -> None:
    snapshot = Conversation(messages=history)
    plan = plan_compaction(snapshot, tail)
    if plan is None:
        return
    appended = tuple(m for turn in later for m in turn)
    current = snapshot.model_copy(update={"messages": history + appended})
    out = splice(current, plan, "s")
    assert out.messages == history[plan.boundary:] + appended
    assert len(out.messages) >= len(plan.live) + len(appended)  # live zone never shrinks
    assert out.messages[0].role == "user"


def test_elided_splice_shortens_old_tool_output_and_keeps_every_message() -> None:
    call = ChatMessage(role="assistant", tool_calls=(ToolCall(name="cat", arguments={}),))
    output = ChatMessage(role="tool", content="x" * 5000, tool_name="cat")
    old = (msg("user", "u0"), call, output, msg("assistant", "a0"))
    current = Conversation(summary="earlier", messages=old + TURNS)
    plan = plan_compaction(current, tail_turns=4)
    assert plan is not None and plan.boundary == len(old)
    out = splice_elided(current, plan, max_chars=100)
    assert out.summary == "earlier" and out.compactions == 1
    assert len(out.messages) == len(current.messages)
    assert out.messages[2].content.startswith("x" * 100)
    assert len(out.messages[2].content) < 200
    assert out.messages[:2] == old[:2] and out.messages[3:] == current.messages[3:]
    moved = current.model_copy(update={"compactions": 3})
    with pytest.raises(SpliceConflict):
        splice_elided(moved, plan)


def tagged(turn: int) -> tuple[ChatMessage, ...]:
    query = f"q{turn}"
    return (ChatMessage(role="user", content=f"u{turn}", query_id=query),
            ChatMessage(role="assistant", content=f"a{turn}", query_id=query))


def test_a_splice_keeps_the_ids_of_the_queries_it_folds() -> None:
    """A query whose acknowledgement was lost may come back after its turn
    was folded into the summary: the snapshot still says it was answered."""
    history = Conversation(messages=tagged(0) + tagged(1) + tagged(2))
    plan = plan_compaction(history, tail_turns=1)
    assert plan is not None
    first = splice(history, plan, "notes")
    assert first.compacted_query_ids == ("q0", "q1")
    folded = fold([HistoryEntry.of_snapshot(first), HistoryEntry.of_turn(tagged(3))])
    assert folded.compacted_query_ids == ("q0", "q1")
    again = plan_compaction(folded, tail_turns=1)
    assert again is not None
    second = splice(folded, again, "more notes")
    assert second.compacted_query_ids == ("q0", "q1", "q2")
    elided = splice_elided(folded, again)  # every message stays, and so do the ids
    assert elided.compacted_query_ids == ("q0", "q1")


def test_the_folded_query_ids_are_bounded_to_the_latest() -> None:
    history = Conversation(messages=tuple(m for t in range(5) for m in tagged(t)),
                           compacted_query_ids=("old1", "old2"))
    assert compacted_query_ids(history, boundary=6, keep=4) == ("old2", "q0", "q1", "q2")
    assert compacted_query_ids(history, boundary=6, keep=0) == ()
