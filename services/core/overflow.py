"""A turn whose prompt would not fit: what a compaction could do about it,
and cutting the turn's own tool output when nothing else can.

An emergency compaction is irreversible and costs a model call, so it is
only started when its best possible outcome fits: the pinned system prompt,
a summary of minimal size, the messages it keeps raw and the turn in
progress. A pasted log larger than the window is refused at once, with the
history untouched. A tool result too large for the turn is cut with a marker
(`cutting`) rather than losing the whole turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from schemas.history import ChatMessage, Conversation
from services.core.boundary import choose_boundary
from services.core.cutting import cut_content, cut_text
from services.core.prompt import render_messages
from services.core.splice import CompactionPlan, plan_compaction
from services.core.summary_prompt import MINIMAL_SUMMARY

# A tool result that must be cut is cut until the prompt takes at most this
# share of the budget (when it can). Cut just to fit, the turn would fill the
# window, and as the last turn, which an emergency compaction keeps raw, it
# would leave no room for any next question: the session would be stuck.
CUT_TO_SHARE = 0.5

# Does the turn in progress fit within this share of the budget?
FitsShare = Callable[[Sequence[ChatMessage], float], bool]


def best_case_prompt(system: str, conversation: Conversation, pending: Sequence[ChatMessage],
                     tail_turns: int) -> list[dict[str, Any]]:
    """The smallest prompt a compaction keeping `tail_turns` turns raw could
    leave: a minimal summary in place of everything before its boundary (the
    prompt as it is when nothing lies before it)."""
    return render_messages(system, best_case(conversation, tail_turns), pending)


def best_case(conversation: Conversation, tail_turns: int) -> Conversation:
    """The conversation a compaction keeping `tail_turns` turns raw could
    leave at the least: a minimal summary in place of everything before its
    boundary (the conversation as it is when nothing lies before it)."""
    boundary = choose_boundary(conversation.messages, tail_turns)
    if boundary == 0:
        return conversation
    return Conversation(summary=MINIMAL_SUMMARY, messages=conversation.messages[boundary:])


def relief_plan(conversation: Conversation, tails: Sequence[int],
                fits: Callable[[Conversation], bool]) -> CompactionPlan | None:
    """The plan keeping the most raw turns (of `tails`) whose best case fits;
    when none does, the one keeping the fewest; None when no tail leaves
    anything to compact. For a context past the emergency line, where the
    usual raw tail could be all that fills it."""
    plans = [(tail, plan) for tail in sorted(set(tails), reverse=True)
             if (plan := plan_compaction(conversation, tail)) is not None]
    if not plans:
        return None
    fitting = (plan for tail, plan in plans if fits(best_case(conversation, tail)))
    return next(fitting, plans[-1][1])


def cut_tool_output(pending: Sequence[ChatMessage], fits: FitsShare
                    ) -> tuple[ChatMessage, ...] | None:
    """The turn as it is when it fits; else with its tool results cut to
    `CUT_TO_SHARE` of the budget, or failing that to the whole budget; None
    when even that is not enough."""
    if fits(pending, 1.0):
        return tuple(pending)
    for share in (CUT_TO_SHARE, 1.0):
        def within(turn: Sequence[ChatMessage], share_: float = share) -> bool:
            return fits(turn, share_)

        cut = cut_tool_results(pending, within)
        if cut is not None:
            return cut
    return None


def cut_tool_results(pending: Sequence[ChatMessage], fits: Callable[[Sequence[ChatMessage]], bool]
                     ) -> tuple[ChatMessage, ...] | None:
    """The turn in progress with its tool results cut, newest first, just
    enough for `fits` to accept it; None when even every result cut to its
    marker is not enough (then no tool output is the cause)."""
    turn = list(pending)
    if fits(turn):
        return tuple(turn)
    for index in reversed(range(len(turn))):
        result = turn[index]
        if result.role != "tool":
            continue

        def fits_with(candidate: ChatMessage, at: int = index) -> bool:
            return fits([*turn[:at], candidate, *turn[at + 1:]])

        cut = cut_content(result, fits_with)
        if cut is not None:
            turn[index] = cut
            return tuple(turn)
        # Not enough on its own: cut it to its marker and go on with the one before.
        turn[index] = _emptied(result)
    return None


def _emptied(result: ChatMessage) -> ChatMessage:
    """A result cut to its marker, or left whole when the marker is not the
    smaller: a short result (a count, an "ok") would only grow, leaving the
    older results less room and the model less to go on. Sized in UTF-8
    bytes, nearer tokens than characters are: forty Chinese characters cost
    more than the marker's fifty-odd ASCII ones."""
    marker = cut_text(result.content, 0)
    if len(marker.encode()) >= len(result.content.encode()):
        return result
    return result.model_copy(update={"content": marker})
