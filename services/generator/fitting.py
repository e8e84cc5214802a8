"""A turn's prompt made to fit its budget before a model call: as it is;
after an emergency compaction, when automatic compaction is on and its best
outcome would fit; with the turn's own tool output cut; or refused with
`context_overflow` and the history untouched. Nothing that would overflow
the window is sent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from schemas.history import ChatMessage
from schemas.messages import ErrorCode, Level
from schemas.session import SessionRecord
from services.core.boundary import tail_turns_for
from services.core.decision import check_fit
from services.core.overflow import FitsShare, best_case_prompt, cut_tool_output
from services.core.prompt import render_messages
from services.core.text_size import Size, prompt_size
from services.core.tokens import estimate_size, stored_calibration
from services.generator.compaction import (
    CompactionFailed,
    CompactionSkipped,
    CompactionStopped,
    Compactor,
)
from services.generator.settings import GeneratorSettings
from services.generator.turn import Messages, Turn, TurnError, WeighedPrompt

log = structlog.get_logger()


def estimate(record: SessionRecord, prompt: Messages, tools: Messages) -> int:
    return size_estimate(record, prompt_size(prompt, tools))


def size_estimate(record: SessionRecord, size: Size) -> int:
    """`estimate` of a prompt weighed already."""
    return estimate_size(size, stored_calibration(record))


def fits(record: SessionRecord, prompt: Messages, tools: Messages, budget: int,
         share: float = 1.0) -> bool:
    """Does the prompt fit (within `share` of the budget), margin kept?"""
    return size_fits(record, prompt_size(prompt, tools), int(share * budget))


def size_fits(record: SessionRecord, size: Size, budget: int) -> bool:
    """`fits` for a prompt weighed already."""
    return check_fit(size_estimate(record, size), budget).fits


@dataclass(frozen=True)
class Fitting:
    """Made for one model call of one turn: it keeps nothing beyond it."""

    settings: GeneratorSettings
    compactor: Compactor
    budget: int
    num_ctx: int

    async def prompt(self, turn: Turn, tools: Messages) -> WeighedPrompt:
        prompt = self._weighed(turn, tools)
        if size_fits(turn.record, prompt.size, self.budget):
            return prompt
        if turn.retry_context is not None:
            # A compaction could fold away the very message to answer again.
            advice = "a retried answer does not compact first: compact the session, then retry"
        elif not self._may_compact(turn.record):
            advice = ("automatic compaction is off for this session: compact it "
                      "(POST /api/sessions/{id}/compact) or shorten the message")
        elif await self._compact_if_it_can_help(turn, tools):
            advice = ("it does not fit even after compaction (a single message larger than "
                      "the window?)")
        else:
            advice = ("no compaction could make room: the system prompt, a minimal summary and "
                      "this turn alone are too large (a single message larger than the window?); "
                      "the history was left as it is")
        prompt = self._weighed(turn, tools)
        if size_fits(turn.record, prompt.size, self.budget):
            return prompt
        # Still over: a tool result too large for the turn is cut, not the turn lost.
        if self._cut_tool_output(turn, lambda pending, share: self._fits(
                turn.record, render_messages(turn.record.system, turn.context, pending),
                tools, share)):
            return self._weighed(turn, tools)
        raise self._overflow(turn.record, prompt.messages, tools, advice)

    async def _compact_if_it_can_help(self, turn: Turn, tools: Messages) -> bool:
        """An emergency compaction, only when its best outcome (a minimal summary
        in place of all but the last turn, or failing that of all of it) would
        fit: it is irreversible and costs a model call. A tool result that keeps
        even that from fitting is cut first. False when nothing could help
        (history untouched)."""
        tail = self._emergency_tail(turn, tools)
        if tail is None:
            log.info("emergency_compaction_cannot_help")
            return False
        prompt = self._render(turn)
        if self._fits(turn.record, prompt, tools):
            return True  # the cut alone made room
        try:
            await self._compact_to_fit(turn, tools, tail)
        except CompactionStopped:
            raise
        except (CompactionSkipped, CompactionFailed) as err:
            raise self._overflow(turn.record, prompt, tools,
                                 f"emergency compaction could not make room: {err}") from err
        return True

    async def _compact_to_fit(self, turn: Turn, tools: Messages, tail: int) -> None:
        """Compacts keeping `tail` turns raw; and if its summary took more than
        the minimal one the choice was priced at (or freed too little to be
        kept), the turn kept raw goes too, rather than the message refused."""
        try:
            await self._compact_within_turn(turn, tail)
        except CompactionStopped:
            raise  # a CompactionSkipped too: stopped, nothing more is tried
        except CompactionSkipped:
            if tail == 0:
                raise
        if (tail > 0 and not turn.switch.thrown
                and not self._fits(turn.record, self._render(turn), tools)
                and self._cut_tool_output(turn, self._best_case_fits(turn, tools, 0))):
            await self._compact_within_turn(turn, 0)

    async def _compact_within_turn(self, turn: Turn, tail: int) -> None:
        turn.view = await self.compactor.compact_within_turn(
            turn.record, turn.view, turn.env.correlation_id, turn.switch, tail)

    def _emergency_tail(self, turn: Turn, tools: Messages) -> int | None:
        """The turns an emergency compaction keeps raw: the emergency level's,
        or none when the last turn alone leaves this one no room (a question
        near the budget and its answer, kept raw, would refuse every later
        message); None when even that would not fit."""
        for tail in (tail_turns_for(Level.emergency, self.settings.compaction_tail_turns), 0):
            if self._cut_tool_output(turn, self._best_case_fits(turn, tools, tail)):
                return tail
        return None

    def _best_case_fits(self, turn: Turn, tools: Messages, tail: int) -> FitsShare:
        """Would the turn fit behind a minimal summary of all but `tail` turns?"""
        def fits(pending: Sequence[ChatMessage], share: float = 1.0) -> bool:
            best = best_case_prompt(turn.record.system, turn.context, pending, tail)
            return self._fits(turn.record, best, tools, share)
        return fits

    def _cut_tool_output(self, turn: Turn, fits: FitsShare) -> bool:
        """The turn's tool results cut (newest first) if it does not fit; False
        when even that is not enough."""
        cut = cut_tool_output(turn.messages, fits)
        if cut is None:
            return False
        if list(cut) != turn.messages:
            log.warning("tool_output_cut", chars_before=sum(len(m.content) for m in turn.messages),
                        chars_after=sum(len(m.content) for m in cut))
        turn.messages = list(cut)
        return True

    def _render(self, turn: Turn) -> Messages:
        return render_messages(turn.record.system, turn.context, turn.messages)

    def _weighed(self, turn: Turn, tools: Messages) -> WeighedPrompt:
        return WeighedPrompt.of(self._render(turn), tools)

    def _may_compact(self, record: SessionRecord) -> bool:
        return self.settings.compaction_threshold > 0 and record.auto_compact

    def _fits(self, record: SessionRecord, prompt: Messages, tools: Messages,
              share: float = 1.0) -> bool:
        return fits(record, prompt, tools, self.budget, share)

    def _overflow(self, record: SessionRecord, prompt: Messages, tools: Messages,
                  advice: str) -> TurnError:
        return TurnError(
            ErrorCode.context_overflow,
            f"the prompt would need about {estimate(record, prompt, tools)} tokens but "
            f"the budget is {self.budget} (num_ctx {self.num_ctx}); {advice}",
        )
