"""Tokens in the context: one count for the gauge, the session read, compaction
results and the decider, and the summary's bound in what a compaction frees."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import Conversation
from schemas.messages import GenerationReport
from services.core.context import (
    context_tokens,
    next_prompt_size,
    next_prompt_tokens,
    part_tokens,
    summary_allowance,
)
from services.core.decision import Observation, Policy, SessionMemory, decide
from services.core.prompt import SUMMARY_PREFIX, render_messages
from services.core.text_size import HistoryWeights, Size
from services.core.tokens import Calibration, estimate_prompt, prompt_budget
from tests.core import histories, text

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                      "parameters": {"path": {"type": "string"}}}},
]
RATIOS = st.one_of(st.none(), st.floats(0.05, 1.5))


@settings(max_examples=200, deadline=None)
@given(text, st.one_of(st.none(), text), histories(), st.booleans(), RATIOS)
def test_every_reader_counts_the_same_prompt_the_same(
    system: str, summary: str | None, messages: Any, with_tools: bool, ratio: float | None
) -> None:
    conversation = Conversation(summary=summary, messages=messages,
                                compactions=int(summary is not None))
    tools = TOOLS if with_tools else []
    calibration = Calibration(ratio)
    count = next_prompt_tokens(system, conversation, tools, calibration)
    # The generator's pre-send check of the same prompt, tools included.
    assert count == estimate_prompt(render_messages(system, conversation), calibration, tools)
    # The decider's, from the figures the generator's report carries.
    size = next_prompt_size(system, conversation, tools)
    report = GenerationReport(session_id="s1", model="m", sent_chars=1, num_ctx=8192,
                              next_prompt_chars=size.chars,
                              next_prompt_extra_bytes=size.extra_bytes,
                              next_prompt_messages=size.messages, tokens_per_char=ratio)
    seen = Size(report.next_prompt_chars or 0, report.next_prompt_extra_bytes,
                report.next_prompt_messages)
    assert context_tokens(seen, Calibration(report.tokens_per_char)) == count


def test_the_offered_tools_count_in_the_context() -> None:
    conversation = Conversation()
    bare = next_prompt_tokens("Be brief.", conversation, [], Calibration(0.25))
    with_tools = next_prompt_tokens("Be brief.", conversation, TOOLS, Calibration(0.25))
    assert with_tools > bare


def test_the_summary_bound_is_the_summarisers_reply_room_and_the_notes_framing() -> None:
    """The summariser's room is an eighth of its window, whatever OUTPUT_HEADROOM
    keeps for answers: a summary was sized at 512 where it may take 4,096, and
    at 3,500 where it may take 1,024."""
    calibration = Calibration(0.25)
    bound = summary_allowance(8192, calibration)
    framing = HistoryWeights.of("", Conversation(summary="")).summary
    assert framing >= len(SUMMARY_PREFIX)
    assert bound == 1024 + round(framing * 0.25)
    assert summary_allowance(2048, calibration) < bound
    assert summary_allowance(32768, calibration) == 4096 + round(framing * 0.25)


@pytest.mark.parametrize(("num_ctx", "headroom"), [(8192, 3500), (16384, 7000), (32768, 16000)])
def test_a_large_output_headroom_still_lets_a_full_session_compact(
        num_ctx: int, headroom: int) -> None:
    calibration = Calibration(0.25)
    limit = prompt_budget(num_ctx, headroom)
    full = Observation(next_prompt_tokens=int(0.99 * limit), budget=limit,
                       compactable_tokens=int(0.85 * limit), now=0.0,
                       summary_allowance=summary_allowance(num_ctx, calibration))
    assert decide(full, SessionMemory(), Policy())[0].fire


def test_a_part_of_a_prompt_takes_its_share_of_the_bytes_and_messages() -> None:
    whole = Size(5000, 10000, 20)
    assert whole.part(3000) == Size(3000, 6000, 12)
    assert whole.part(0) == Size() and whole.part(-5) == Size()
    assert whole.part(9000) == Size(9000, 10000, 20)  # never more than the whole has
    assert Size().part(100) == Size(100)


@given(st.integers(1, 100_000), st.integers(0, 300_000), st.integers(0, 500),
       st.floats(0.0, 1.0))
def test_the_parts_of_a_prompt_never_cost_more_than_the_whole(
        chars: int, extra: int, messages: int, share: float) -> None:
    whole = Size(chars, extra, messages)
    cal = Calibration(tokens_per_char=0.25, tokens_per_extra_byte=0.5)
    part = int(chars * share)
    assert part_tokens(whole, part, cal) <= context_tokens(whole, cal) + 1
