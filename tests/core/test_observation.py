"""A generation report read as the decider's observation of the next call."""

from __future__ import annotations

from schemas.messages import GenerationReport
from services.core.context import context_tokens
from services.core.decision import Policy
from services.core.observation import next_prompt, observe, report_calibration
from services.core.text_size import Size
from services.core.tokens import Calibration, prompt_budget

CAL = Calibration(0.25)
POLICY = Policy()


def report(next_chars: int, **fields: object) -> GenerationReport:
    return GenerationReport.model_validate({
        "session_id": "s", "model": "m", "sent_chars": 400, "sent_messages": 2,
        "num_ctx": 8192, "next_prompt_chars": next_chars, "next_prompt_messages": 4, **fields})


def test_the_next_prompt_is_the_call_just_made_when_the_report_does_not_say() -> None:
    assert next_prompt(report(0)) == Size(400, 0, 2)
    assert next_prompt(report(900, next_prompt_extra_bytes=3)) == Size(900, 3, 4)


def test_the_reports_own_rates_come_before_the_ones_known_here() -> None:
    assert report_calibration(report(500), CAL) is CAL
    carried = report_calibration(report(500, tokens_per_char=0.5), CAL)
    assert carried.tokens_per_char == 0.5


def test_what_a_compaction_frees_is_its_levels_own_zone() -> None:
    levels = {"gentle": 10_000, "tighter": 12_000, "emergency": 14_000}
    calm = observe(report(4_000, compactable_chars=2_000, compactable_chars_by_level=levels),
                   CAL, None, POLICY, now=1.0)
    assert calm.compactable_tokens == context_tokens(Size(4_000, 0, 4).part(2_000), CAL)
    crowded = observe(report(28_000, compactable_chars=20_000,
                             compactable_chars_by_level=levels), CAL, None, POLICY, now=1.0)
    assert crowded.budget == prompt_budget(8192)
    assert crowded.compactable_tokens == context_tokens(Size(28_000, 0, 4).part(14_000), CAL)


def test_a_generator_that_does_not_say_what_is_freeable_is_priced_as_all_of_it() -> None:
    silent = observe(report(28_000), CAL, None, POLICY, now=1.0)
    assert silent.compactable_tokens == silent.next_prompt_tokens
