"""Summarising a compact zone in pieces that each fit the summariser's window."""

from __future__ import annotations

import pytest

from schemas.history import ChatMessage, Conversation
from schemas.messages import Level
from services.core.boundary import tail_turns_for
from services.core.pieces import NothingFits, SummaryWindow, Zone, count_pieces, next_piece
from services.core.splice import first_user_request, plan_compaction
from services.core.summary_prompt import FIRST_REQUEST_REFERENCE, summary_messages
from services.core.tokens import Calibration, estimate_prompt

CALIBRATED = Calibration(0.25, reports=3)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def answer(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def spec_then_questions(turns: int) -> Conversation:
    """A pasted spec as the first request, then ordinary turns."""
    messages = [user("SPEC " + "F" * 8000), answer("r" * 1500)]
    for i in range(turns):
        messages += [user(f"q{i} " + "q" * 600), answer(f"a{i} " + "a" * 1700)]
    return Conversation(messages=(*messages, user("last"), answer("ok")))


def all_pieces(zone: Zone, window: SummaryWindow, notes: str | None = None
               ) -> list[tuple[int, int, list[dict[str, str]]]]:
    """Every piece in turn, each given the notes a tiny summariser would write."""
    out, start = [], 0
    while start < len(zone.entries):
        piece = next_piece(zone, start, notes, window)
        out.append((piece.start, piece.end, piece.messages))
        notes, start = f"## Goal\n- notes after entry {piece.end}", piece.end
    return out


def test_one_call_over_the_whole_zone_would_not_fit_but_every_piece_does() -> None:
    conversation = spec_then_questions(8)
    plan = plan_compaction(conversation, tail_turns_for(Level.emergency, 4))
    assert plan is not None
    window = SummaryWindow.for_summaries(8192, CALIBRATED)
    whole = summary_messages(None, plan.to_compact, first_user_request(conversation))
    assert not window.fits(whole)
    zone = Zone.of(plan.to_compact, first_user_request(conversation))
    pieces = all_pieces(zone, window)
    assert len(pieces) > 1
    assert all(window.fits(messages) for _, _, messages in pieces)
    # Every entry once, in order.
    assert [p[0] for p in pieces] == [0, *[p[1] for p in pieces[:-1]]]
    assert pieces[-1][1] == len(plan.to_compact)
    assert count_pieces(zone, "## Goal\n- notes after entry 10", window) == len(pieces)


def test_the_first_request_is_sent_once_and_only_in_the_first_piece() -> None:
    conversation = spec_then_questions(8)
    spec = first_user_request(conversation)
    assert spec is not None
    zone = Zone.of(conversation.messages[:-2], spec)
    pieces = all_pieces(zone, SummaryWindow.for_summaries(8192, CALIBRATED))
    first = pieces[0][2][1]["content"]
    assert first.count(spec) == 1 and FIRST_REQUEST_REFERENCE in first
    for _, _, later in pieces[1:]:
        assert spec not in later[1]["content"] and "FIRST REQUEST" not in later[1]["content"]
        assert "EARLIER NOTES" in later[1]["content"]
        assert "earlier notes verbatim" in later[0]["content"]


def test_the_earlier_summary_is_merged_into_the_first_piece() -> None:
    zone = Zone.of((user("hello"), answer("hi")), None, "keep the ids")
    piece = next_piece(zone, 0, "## Goal\n- old notes", SummaryWindow.for_summaries(2048,
                                                                                   CALIBRATED))
    assert (piece.start, piece.end, piece.cut_chars) == (0, 2, 0)
    content = piece.messages[1]["content"]
    assert "## Goal\n- old notes" in content and content.endswith("keep the ids")


def test_one_entry_larger_than_any_piece_is_cut_with_a_marker() -> None:
    huge = ChatMessage(role="tool", tool_name="dump", content="#7: " + "x" * 40_000)
    zone = Zone.of((user("go"), huge, answer("done")), None)
    window = SummaryWindow.for_summaries(2048, CALIBRATED)
    pieces = all_pieces(zone, window)
    assert all(window.fits(messages) for _, _, messages in pieces)
    cut = next(messages[1]["content"] for start, _, messages in pieces if start == 1)
    assert "[tool result: dump]\n#7: xxx" in cut and "characters left out here" in cut
    assert next_piece(zone, 1, None, window).cut_chars > 30_000


def test_a_pasted_first_request_is_cut_to_leave_room_for_the_transcript() -> None:
    spec = "S" * 20_000
    zone = Zone.of((user(spec), answer("ok"), user("next"), answer("fine")), spec)
    window = SummaryWindow.for_summaries(2048, CALIBRATED)
    piece = next_piece(zone, 0, None, window)
    assert window.fits(piece.messages)
    assert "characters left out here" in piece.messages[1]["content"]
    assert piece.end == 4  # the transcript still fits beside it


def test_notes_larger_than_the_window_are_refused() -> None:
    zone = Zone.of((user("go"), answer("done")), None)
    with pytest.raises(NothingFits, match="summariser's window"):
        next_piece(zone, 0, "n" * 20_000, SummaryWindow.for_summaries(2048, CALIBRATED))


def test_more_room_for_the_summary_means_smaller_pieces_up_to_half_the_window() -> None:
    window = SummaryWindow.for_summaries(2048, CALIBRATED)
    assert window.output_tokens == 256 and window.prompt_budget == 1792
    more = window.with_more_room()
    assert more is not None and more.output_tokens == 512 and more.prompt_budget == 1536
    most = more.with_more_room()
    assert most is not None and most.output_tokens == 1024 and most.with_more_room() is None
    zone = Zone.of(spec_then_questions(4).messages, None)
    assert next_piece(zone, 0, None, most).end <= next_piece(zone, 0, None, window).end


def test_the_estimate_is_the_calibrated_one_with_the_turns_margin() -> None:
    window = SummaryWindow.for_summaries(2048, CALIBRATED)
    zone = Zone.of(spec_then_questions(4).messages, None)
    piece = next_piece(zone, 0, None, window)
    assert estimate_prompt(piece.messages, CALIBRATED) <= 0.95 * window.prompt_budget
    grown = summary_messages(None, spec_then_questions(4).messages[:piece.end + 1], None)
    assert estimate_prompt(grown, CALIBRATED) > 0.95 * window.prompt_budget
