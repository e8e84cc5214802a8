"""What a generation report says of a session's next call, in tokens: the
decider's observation, made from the report alone (and the session's rates,
when the report does not carry them)."""

from __future__ import annotations

from schemas.messages import GenerationReport
from services.core.context import context_tokens, part_tokens, summary_allowance
from services.core.decision import Observation, Policy, level_for
from services.core.text_size import Size
from services.core.tokens import Calibration, calibration_from, prompt_budget


def report_calibration(report: GenerationReport, known: Calibration) -> Calibration:
    """The session's own rates when the report carries them: the estimate is
    then the very number the gauge and the compaction results show."""
    if report.tokens_per_char is None:
        return known
    return calibration_from(report.tokens_per_char, report.tokens_per_extra_byte,
                            report.count_basis)


def next_prompt(report: GenerationReport) -> Size:
    """What the session's next call sends, as the report says (the call just
    made, from a generator that does not say)."""
    if report.next_prompt_chars:
        return Size(report.next_prompt_chars, report.next_prompt_extra_bytes,
                    report.next_prompt_messages)
    return Size(report.sent_chars, report.sent_extra_bytes, report.sent_messages)


def observe(report: GenerationReport, calibration: Calibration, output_headroom: int | None,
            policy: Policy, now: float) -> Observation:
    whole = next_prompt(report)
    upcoming = context_tokens(whole, calibration)
    limit = prompt_budget(report.num_ctx, output_headroom)
    return Observation(
        next_prompt_tokens=upcoming, budget=limit,
        compactable_tokens=part_tokens(whole, _freeable(report, whole, upcoming, limit, policy),
                                       calibration),
        now=now,
        summary_tokens=part_tokens(whole, report.summary_chars, calibration),
        summary_allowance=summary_allowance(report.num_ctx, calibration),
        compactions=report.compactions)


def _freeable(report: GenerationReport, whole: Size, upcoming: int, limit: int,
              policy: Policy) -> int:
    """Characters a compaction at the level this estimate calls for replaces:
    its own, smaller live zone. A generator that does not say is not taken to
    have nothing to free (that vetoed every compaction): priced as all of it,
    the request goes, and the generator, which knows, skips what it cannot fold."""
    freeable = whole.chars if report.compactable_chars is None else report.compactable_chars
    level = level_for(upcoming, limit, policy)
    if level is not None:
        freeable = report.compactable_chars_by_level.get(level, freeable)
    return freeable
