"""What an emergency compaction could do for a turn, and cutting the turn's tool output."""

from __future__ import annotations

from schemas.history import ChatMessage, Conversation, ToolCall
from services.core.decision import check_fit
from services.core.overflow import (
    CUT_TO_SHARE,
    best_case_prompt,
    cut_tool_output,
    cut_tool_results,
    relief_plan,
)
from services.core.prompt import render_messages
from services.core.splice import CompactionPlan
from services.core.summary_prompt import MINIMAL_SUMMARY
from services.core.tokens import Calibration, estimate_prompt, prompt_budget

CAL, NUM_CTX = Calibration(0.25), 8192
BUDGET = prompt_budget(NUM_CTX)


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def answer(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def fits(messages: list[dict[str, object]]) -> bool:
    return check_fit(estimate_prompt(messages, CAL), BUDGET).fits


HISTORY = Conversation(messages=(user("a" * 4000), answer("b" * 4000), user("c" * 4000),
                                 answer("d" * 4000)))


def test_a_paste_larger_than_the_window_cannot_fit_whatever_is_compacted() -> None:
    paste = [user("x" * 30_000)]  # about 7,500 tokens against a limit of 6,809
    assert not fits(render_messages("", HISTORY, paste))
    assert not fits(best_case_prompt("", HISTORY, paste, tail_turns=1))


def test_a_message_that_fits_once_the_history_is_summarised() -> None:
    question = [user("y" * 12_000)]
    assert not fits(render_messages("Be brief.", HISTORY, question))
    best = best_case_prompt("Be brief.", HISTORY, question, tail_turns=1)
    assert fits(best)
    assert best[0] == {"role": "system", "content": "Be brief."}
    assert MINIMAL_SUMMARY in best[1]["content"]
    assert [m["content"] for m in best[2:]] == ["c" * 4000, "d" * 4000, "y" * 12_000]


def test_with_nothing_before_the_last_turn_the_best_case_is_the_prompt_itself() -> None:
    short = Conversation(messages=(user("only"), answer("one")))
    assert best_case_prompt("", short, [user("z")], 1) == render_messages("", short, [user("z")])


FOUR_TURNS = Conversation(messages=tuple(
    m for i in range(4) for m in (user(f"q{i} " + "a" * 4000), answer(f"r{i} " + "b" * 4000))))


def raw_turns(conversation: Conversation) -> int:
    return sum(m.role == "user" for m in conversation.messages)


def kept_raw(plan: CompactionPlan | None) -> int:
    assert plan is not None
    return raw_turns(Conversation(messages=plan.live))


def test_relief_keeps_the_most_raw_turns_whose_best_case_fits() -> None:
    assert kept_raw(relief_plan(FOUR_TURNS, (2, 1, 0), lambda least: True)) == 2
    assert kept_raw(relief_plan(FOUR_TURNS, (2, 1, 0),
                                lambda least: raw_turns(least) <= 1)) == 1


def test_relief_keeps_the_fewest_when_no_best_case_fits() -> None:
    assert kept_raw(relief_plan(FOUR_TURNS, (2, 1, 0), lambda least: False)) == 0


def test_relief_weighs_the_best_case_a_compaction_could_leave() -> None:
    seen: list[Conversation] = []
    relief_plan(FOUR_TURNS, (1, 2), lambda least: bool(seen.append(least)))
    assert [raw_turns(c) for c in seen] == [2, 1]  # the most kept raw asked first
    assert all(c.summary == MINIMAL_SUMMARY for c in seen)


def test_relief_with_the_whole_history_in_one_turn_compacts_it_all_or_nothing() -> None:
    one = Conversation(messages=(user("only"), answer("one")))
    assert kept_raw(relief_plan(one, (2, 1, 0), lambda least: True)) == 0
    assert relief_plan(one, (2, 1), lambda least: True) is None
    assert relief_plan(Conversation(), (2, 1, 0), lambda least: True) is None


def turn_with_results(*sizes: int) -> list[ChatMessage]:
    turn = [user("look")]
    for i, size in enumerate(sizes):
        turn += [ChatMessage(role="assistant", content="",
                             tool_calls=(ToolCall(name="dump", arguments={"n": i}),)),
                 ChatMessage(role="tool", tool_name="dump", content=f"#{i}: " + "o" * size)]
    return turn


def test_an_oversized_tool_result_is_cut_to_what_fits() -> None:
    turn = turn_with_results(100, 50_000)
    cut = cut_tool_results(turn, lambda t: fits(render_messages("", HISTORY, t)))
    assert cut is not None and fits(render_messages("", HISTORY, cut))
    assert cut[:4] == tuple(turn[:4])  # the earlier result is whole
    assert cut[4].content.startswith("#1: ooo") and "characters left out here" in cut[4].content
    assert len(cut[4].content) > 1000  # cut just enough, not emptied


def test_results_are_cut_newest_first_and_a_turn_without_them_is_left_alone() -> None:
    turn = turn_with_results(30_000, 30_000)
    cut = cut_tool_results(turn, lambda t: fits(render_messages("", Conversation(), t)))
    assert cut is not None
    # Neither fits beside the other: the newest is cut to its marker, the older one cut too.
    assert cut[4].content.startswith("\n[… 30,004 characters left out here")
    assert cut[2].content.startswith("#0: ooo") and "left out here" in cut[2].content
    assert cut_tool_results([user("x" * 40_000)], lambda t: fits(
        render_messages("", Conversation(), t))) is None
    assert cut_tool_results(turn_with_results(10), lambda t: True) == tuple(turn_with_results(10))


def test_a_result_that_must_be_cut_leaves_room_for_the_next_question() -> None:
    """Cut only just to fit, the turn would fill the window and, kept raw as the
    last turn by every emergency compaction, leave no room for a next turn."""
    def fits_share(turn: object, share: float) -> bool:
        assert isinstance(turn, (list, tuple))
        estimate = estimate_prompt(render_messages("", Conversation(), turn), CAL)
        return check_fit(estimate, int(share * BUDGET)).fits

    turn = turn_with_results(60_000)
    cut = cut_tool_output(turn, fits_share)
    assert cut is not None and fits_share(cut, CUT_TO_SHARE)
    assert estimate_prompt(render_messages("", Conversation(), cut), CAL) > 0.4 * BUDGET
    small = turn_with_results(100)
    assert cut_tool_output(small, fits_share) == tuple(small)  # fits: nothing cut
    assert cut_tool_output([user("x" * 40_000)], fits_share) is None


def test_a_short_result_is_never_swapped_for_a_longer_marker() -> None:
    """Eight short results newer than one too large: cut to their markers,
    each longer than itself, they took the room the large one needed, and the
    turn was refused though cutting the large one alone fits."""
    turn = [user("q" * 26_000), *turn_with_results(100_000)[1:]]
    for i in range(8):
        turn += [ChatMessage(role="assistant", content="",
                             tool_calls=(ToolCall(name="check", arguments={"n": i}),)),
                 ChatMessage(role="tool", tool_name="check", content="ok")]
    cut = cut_tool_results(turn, lambda t: fits(render_messages("", Conversation(), t)))
    assert cut is not None
    assert [m.content for m in cut if m.tool_name == "check"] == ["ok"] * 8
    assert "left out here" in cut[2].content

    counted = [*turn_with_results(60_000), ChatMessage(
        role="assistant", content="", tool_calls=(ToolCall(name="wc"),)),
        ChatMessage(role="tool", tool_name="wc", content="60000")]
    cut = cut_tool_results(counted, lambda t: fits(render_messages("", Conversation(), t)))
    assert cut is not None and cut[-1].content == "60000"


def test_a_short_result_in_a_dense_script_is_still_swapped_for_the_marker() -> None:
    """Fewer characters than the marker, but three bytes each: dearer than it."""
    dense = "字" * 40
    turn = [*turn_with_results(60_000), ChatMessage(
        role="assistant", content="", tool_calls=(ToolCall(name="look"),)),
        ChatMessage(role="tool", tool_name="look", content=dense)]

    def fits_only_without_it(t: list[ChatMessage]) -> bool:  # as if it alone were too dear
        return fits(render_messages("", Conversation(), t)) and t[-1].content != dense

    emptied = cut_tool_results(turn, fits_only_without_it)
    assert emptied is not None and "left out here" in emptied[-1].content
