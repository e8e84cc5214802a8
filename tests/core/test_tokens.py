from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, Conversation, HistoryEntry, Snapshot
from schemas.session import SessionRecord
from services.core.decision import check_fit
from services.core.prompt import render_messages
from services.core.prompt_cache import cached_size, previous_call
from services.core.rates import Sample
from services.core.text_size import prompt_size
from services.core.tokens import (
    FALLBACK_TOKENS_PER_CHAR,
    RATE_FALL_KEPT,
    Calibration,
    budget,
    calibrate,
    default_headroom,
    estimate_prompt,
    estimate_tokens,
    prompt_budget,
    rate_moved,
    refused_as_too_long,
    stored_calibration,
    with_calibration,
    worth_storing,
)

NUM_CTX = 32768
PRIOR = Calibration(0.2, 3)


def test_first_usable_report_sets_the_ratio() -> None:
    assert calibrate(Calibration(), 2500, 10000, NUM_CTX) == Calibration(0.25, 1)


def test_latest_sample_wins() -> None:
    assert calibrate(PRIOR, 1000, 8000, NUM_CTX) == Calibration(0.125, 4)


@pytest.mark.parametrize(
    ("reported", "sent", "why"),
    [
        (None, 10000, "missing count"),
        (0, 10000, "zero is a missing count, not an empty prompt"),
        (-5, 10000, "nonsense"),
        (833, 10000, "fewer tokens than sent/12: a cache-reuse undercount"),
        (1000, 0, "nothing sent"),
        (math.ceil(0.98 * NUM_CTX), 400000, "at the truncation cap"),
        (NUM_CTX, 400000, "exactly num_ctx: truncated"),
    ],
)
def test_untrustworthy_reports_change_nothing(reported: int | None, sent: int, why: str) -> None:
    assert calibrate(PRIOR, reported, sent, NUM_CTX) is PRIOR, why


def test_a_count_capped_by_truncation_raises_the_ratio_and_never_lowers_it() -> None:
    """Once an estimate fell below the truth, every prompt it let through was
    truncated, and every count of those was thrown away: it never recovered."""
    low = Calibration(0.114, 3)
    out = calibrate(low, 8100, 30000, 8192)
    assert out.tokens_per_char is not None and out.tokens_per_char >= 8100 / 30000
    assert calibrate(Calibration(0.3, 3), 8100, 30000, 8192) == Calibration(0.3, 3)


def test_a_dense_new_part_counted_alone_is_not_read_as_a_sparse_whole() -> None:
    """Prose at 0.25 a character, then 4,000 new characters at 0.625 (base64,
    say), counted alone as Ollama does after its cache: 2,504 tokens, nearer
    the 6,000 a whole would cost than the 1,000 the new part would at the
    session's rate. Read as whole, the rate fell to 0.10 and the next
    estimate was a third of the truth, every later turn."""
    prose = Calibration(0.25, 3)
    out = calibrate(prose, 2504, 24000, NUM_CTX, reused_chars=20000)
    assert out.tokens_per_char is not None and out.tokens_per_char >= 0.25


def test_just_plausible_and_just_below_the_cap_are_used() -> None:
    assert calibrate(PRIOR, 834, 10000, NUM_CTX).reports == 4
    below_cap = math.ceil(0.98 * NUM_CTX) - 1
    assert calibrate(PRIOR, below_cap, 4 * below_cap, NUM_CTX).tokens_per_char == 0.25


def test_a_count_is_read_as_whole_or_as_the_part_after_the_cache() -> None:
    # 10000 chars sent, extending a 6000-char previous call a cache may have served.
    # More tokens than the fresh part has bytes cannot be of it alone.
    assert calibrate(PRIOR, 4100, 10000, NUM_CTX, reused_chars=6000) == Calibration(0.41, 4)
    # Nearer (in ratio) the whole prompt's expected 2000 than the fresh part's 800.
    assert calibrate(PRIOR, 2100, 10000, NUM_CTX, reused_chars=6000) == Calibration(0.21, 4)
    # Nearer the fresh part's: the cached part keeps the ratio shown, 1200 tokens.
    assert calibrate(PRIOR, 1000, 10000, NUM_CTX, reused_chars=6000) == Calibration(0.22, 4)
    # Nothing fresh (identical prompt) or nothing reusable: the plain rules apply.
    assert calibrate(PRIOR, 3000, 10000, NUM_CTX, reused_chars=10000).reports == 4
    assert calibrate(PRIOR, 3000, 10000, NUM_CTX, reused_chars=0).reports == 4


def test_a_count_that_may_be_partial_never_lowers_the_ratio() -> None:
    # The fresh part is most of the prompt: a whole count and a partial one
    # would be too alike to tell apart. Lower than the ratio shown: ignored.
    assert calibrate(PRIOR, 1500, 10000, NUM_CTX, reused_chars=2000) is PRIOR
    # Higher: the whole prompt costs at least that much, whichever it is.
    assert calibrate(PRIOR, 2500, 10000, NUM_CTX, reused_chars=2000) == Calibration(0.25, 4)
    # Read as partial, a count that would lower the ratio is ignored too: the
    # cache may have held more than we know (the call of a failed turn).
    assert calibrate(PRIOR, 150, 10000, NUM_CTX, reused_chars=9000) is PRIOR


def test_a_dense_count_of_only_the_new_part_is_not_taken_for_the_whole() -> None:
    """1.3 tokens per character (Chinese on a 32k-vocabulary model): the count
    of the 1000 new characters alone is 1300. The rule "at most one token per
    new character" took it for the whole 10000: 0.13, ten times too low."""
    dense = Calibration(1.3, 1)
    assert calibrate(dense, 1300, 10000, NUM_CTX, reused_chars=9000) is dense
    chinese = Calibration(0.9, 1)
    assert calibrate(chinese, 900, 10000, NUM_CTX, reused_chars=9000) is chinese
    # Told the bytes, 1000 new CJK characters after ASCII may cost up to 3000
    # tokens: 700 of them is read as theirs alone, and raises the ratio.
    out = calibrate(PRIOR, 700, 10000, NUM_CTX, extra_bytes=2000, reused_chars=9000)
    assert out.tokens_per_char == pytest.approx(0.25)


def test_a_first_count_that_may_be_partial_leaves_the_session_uncalibrated() -> None:
    # No ratio shown yet: nothing to tell a partial count from a whole one by.
    assert calibrate(Calibration(), 1000, 10000, NUM_CTX, reused_chars=1000) == Calibration()
    # ...unless it exceeds what the rest could cost.
    assert calibrate(Calibration(), 2000, 2100, NUM_CTX, reused_chars=2000).reports == 1


def test_estimate_uses_ratio_or_conservative_fallback() -> None:
    assert estimate_tokens(1000, Calibration()) == 400
    assert estimate_tokens(1001, Calibration()) == 401  # rounds up
    assert estimate_tokens(1000, Calibration(1 / 7, 1)) == 143
    assert estimate_tokens(0, PRIOR) == 0
    assert pytest.approx(0.4) == FALLBACK_TOKENS_PER_CHAR


def test_budget_and_headroom() -> None:
    assert budget(8192, 1024) == 7168
    assert budget(100, 500) == 1
    assert default_headroom(2048) == 256
    assert default_headroom(1024) == 256
    assert default_headroom(262144) == 32768
    with pytest.raises(ValueError):
        budget(0, 10)
    with pytest.raises(ValueError):
        budget(10, -1)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 10**6),
    st.integers(0, 10**6),
    st.integers(512, 300000),
    st.integers(0, 10**6),
)
def test_calibrate_properties(sent: int, reported: int, num_ctx: int, reused: int) -> None:
    out = calibrate(PRIOR, reported, sent, num_ctx, reused_chars=reused)
    if out is PRIOR:
        return
    assert out.reports == PRIOR.reports + 1
    assert out.tokens_per_char is not None
    # What is accepted is plausible for what the cache cannot have held.
    fresh = max(0, sent - reused)
    assert reported * 12 >= fresh
    # A count that may cover only the part after the cache, or that truncation
    # capped, never lowers the ratio.
    assert PRIOR.tokens_per_char is not None
    truncated = reported >= 0.98 * num_ctx
    surely_whole = reused <= 0 or reused >= sent or reported > fresh
    if truncated or not surely_whole:
        assert out.tokens_per_char > PRIOR.tokens_per_char


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**7), st.floats(1 / 12, 1.0))
def test_estimate_is_monotone_and_never_below_exact(chars: int, ratio: float) -> None:
    cal = Calibration(ratio, 1)
    assert estimate_tokens(chars, cal) >= chars * ratio
    assert estimate_tokens(chars + 1, cal) >= estimate_tokens(chars, cal)


def test_the_stand_ins_cache_count_would_poison_a_plain_calibration() -> None:
    """A big tool result after a cached prompt: the provider counts only the suffix.

    4 chars per token; the previous prompt was 4000 chars (1000 tokens), the new
    one adds an 8000-char result. Counted as a suffix it reports 2000 of the
    3000 tokens: plausible for 12000 chars, so the plain rule takes a ratio a
    third too low. Told what was reusable, calibrate keeps the true ratio.
    """
    truth = Calibration(0.25, 1)
    suffix_only = 2000
    poisoned = calibrate(truth, suffix_only, 12000, NUM_CTX)
    assert poisoned.tokens_per_char == pytest.approx(1 / 6)
    assert calibrate(truth, suffix_only, 12000, NUM_CTX, reused_chars=4000) is truth
    # Counted in full (the cache was evicted), the same prompt is just as ambiguous.
    assert calibrate(truth, 3000, 12000, NUM_CTX, reused_chars=4000) is truth
    # A short suffix settles it: 1025 tokens cannot be a count of 100 new characters.
    assert calibrate(truth, 1025, 4100, NUM_CTX, reused_chars=4000) == Calibration(0.25, 2)
    # Nothing reusable: the count is complete.
    assert calibrate(truth, 750, 3000, NUM_CTX, reused_chars=0) == Calibration(0.25, 2)


def test_dense_text_is_charged_at_its_own_cautious_rate() -> None:
    """15,000 Chinese characters cost at least 9,750 tokens on common tokenizers:
    at the text ratio the fallback said 6,004 and the message was sent into an
    8,192 window."""
    message = [{"role": "user", "content": "中文" * 7500}]
    limit = prompt_budget(8192)
    for calibration in (Calibration(), Calibration(0.25, 3)):
        estimate = estimate_prompt(message, calibration)
        assert estimate >= 15000
        assert not check_fit(estimate, limit).fits
    # Cyrillic (two bytes) on top of a 0.25 ratio: (1 - 0.25) / 2 more per character.
    assert estimate_prompt([{"role": "user", "content": "я" * 1000}], Calibration(0.25, 1)) == (
        math.ceil(1000 * 0.625) + 4)
    # Mixed text: ASCII at the ratio, CJK at one token each.
    assert estimate_tokens(1000, Calibration(0.25, 1), 0, extra_bytes=200) == 250 + 75


def test_dense_text_that_weighs_little_does_not_lower_the_ratio() -> None:
    # 9900 ASCII chars at 0.25 and 100 CJK ones at 0.7: a whole count of 2545.
    out = calibrate(Calibration(), 2545, 10000, NUM_CTX, extra_bytes=200)
    assert out.tokens_per_char == pytest.approx((2545 - 200 * 0.3) / 10000)
    # Where dense text carries the prompt, the ratio takes all of the count: too
    # high for the ASCII in it, never too low, whatever CJK costs.
    heavy = calibrate(Calibration(), 4000, 10000, NUM_CTX, extra_bytes=10000)
    assert heavy.tokens_per_char == pytest.approx(0.4)
    assert estimate_tokens(10000, heavy, 0, 10000) >= 4000


def test_after_a_compaction_a_big_cached_system_prompt_does_not_halve_the_ratio() -> None:
    """4 characters per token, a 6,000-character system prompt. The first call
    after a compaction is counted without the system prompt (still cached):
    read as the whole prompt it took the ratio from 0.25 to 0.121, and a true
    10,498-token prompt was estimated at 5,106 and found to fit in 8,192."""
    system = "S" * 6000
    before = Conversation(messages=(ChatMessage(role="user", content="u" * 9000),
                                    ChatMessage(role="assistant", content="a" * 9000)))
    kept = (ChatMessage(role="user", content="q" * 300),
            ChatMessage(role="assistant", content="b" * 3000))
    after = before.apply(HistoryEntry.of_snapshot(Snapshot(summary="N" * 2000, messages=kept,
                                                           compactions=1)))
    now = render_messages(system, after, [ChatMessage(role="user", content="next" * 50)])
    reused = cached_size(previous_call(system, after), now)
    assert reused.chars == prompt_size(now[:1]).chars
    size = prompt_size(now)
    true_of = _true_tokens
    reported = true_of(now) - true_of(now[:1])  # Ollama counts what it evaluated
    cal = calibrate(Calibration(0.25, 5), reported, size.chars, 8192, messages=size.messages,
                    reused_chars=reused.chars, reused_messages=reused.messages)
    assert cal.tokens_per_char == pytest.approx(0.25, rel=0.02)
    grown = render_messages(system, after, [
        ChatMessage(role="user", content="next" * 50),
        ChatMessage(role="assistant", content="c" * 30000),
        ChatMessage(role="user", content="more" * 50)])
    assert true_of(grown) > 8192
    assert not check_fit(estimate_prompt(grown, cal), prompt_budget(8192)).fits


def test_on_another_generator_the_previous_call_is_read_off_the_history() -> None:
    """The first turn on a generator that did not send the session's previous
    call: with an 8,000-character paste the ratio fell to 0.0995 and a true
    8,653-token prompt was estimated at 3,462."""
    turns = Conversation()
    for question, answer in (("u" * 400, "a" * 14000), ("v" * 600, "w" * 2000)):
        turns = turns.apply(HistoryEntry.of_turn((ChatMessage(role="user", content=question),
                                                  ChatMessage(role="assistant", content=answer))))
    sent_before = render_messages("", turns)[:-1]  # what the other process sent last
    call = render_messages("", turns, [ChatMessage(role="user", content="p" * 8000)])
    reused = cached_size(previous_call("", turns), call)
    assert reused == cached_size(sent_before, call)
    reported = _true_tokens(call) - _true_tokens(sent_before)
    size = prompt_size(call)
    cal = calibrate(Calibration(0.25, 4), reported, size.chars, 8192, messages=size.messages,
                    reused_chars=reused.chars, reused_messages=reused.messages)
    assert cal.tokens_per_char == pytest.approx(0.25, rel=0.02)


def _true_tokens(messages: list[dict[str, Any]]) -> int:
    """A tokenizer at 4 characters per token with 4 tokens of framing per message."""
    return sum(math.ceil(len(m["content"]) / 4) + 4 for m in messages)


# Dense scripts: a CJK character is one character and two extra UTF-8 bytes.
CHAR_RATE, BYTE_RATE = 0.25, 0.3


def _true_cost(chars: int, extra_bytes: int) -> float:
    return chars * CHAR_RATE + extra_bytes * BYTE_RATE


def _count(previous: Calibration, chars: int, extra_bytes: int, **reuse: int) -> Calibration:
    reported = round(_true_cost(chars, extra_bytes) - _true_cost(
        reuse.get("reused_chars", 0), reuse.get("reused_extra_bytes", 0)))
    return calibrate(previous, reported, chars, NUM_CTX, extra_bytes=extra_bytes, **reuse)


def test_two_counts_of_different_make_up_learn_the_rate_of_dense_text() -> None:
    prose = _count(Calibration(), 8000, 0)
    assert prose.tokens_per_extra_byte is None  # nothing dense counted yet
    both = _count(prose, 9000, 6000)
    assert both.tokens_per_char == pytest.approx(CHAR_RATE, rel=1e-3)
    assert both.tokens_per_extra_byte == pytest.approx(BYTE_RATE, rel=1e-3)
    # A prompt of yet another make-up is now estimated within rounding.
    true = _true_cost(3000, 9000)
    assert estimate_tokens(3000, both, extra_bytes=9000) == pytest.approx(true, rel=0.01)


def test_before_dense_text_is_counted_it_is_charged_cautiously() -> None:
    prose = _count(Calibration(), 8000, 0)
    assert estimate_tokens(3000, prose, extra_bytes=6000) > _true_cost(3000, 6000)


def test_a_count_that_may_be_partial_never_lowers_a_learnt_rate() -> None:
    learnt = _count(_count(Calibration(), 8000, 0), 9000, 6000)
    # The cache held more than we know: the count is of a shorter suffix.
    short = calibrate(learnt, 300, 12000, NUM_CTX, extra_bytes=6000,
                      reused_chars=9000, reused_extra_bytes=6000)
    assert short.char_rate >= learnt.char_rate
    assert short.extra_byte_rate >= learnt.extra_byte_rate


def test_a_lone_dense_count_does_not_teach_a_dense_rate() -> None:
    first = _count(Calibration(), 9000, 6000)
    assert first.tokens_per_extra_byte is None
    # Charged to all characters alike: never an underestimate of other text.
    assert first.char_rate >= CHAR_RATE


def test_a_session_record_keeps_both_rates_and_the_count_they_are_solved_against() -> None:
    learnt = _count(_count(Calibration(), 8000, 0), 9000, 6000)
    record = with_calibration(SessionRecord(session_id="s"), learnt)
    stored = stored_calibration(record)
    # The count of reports is not kept: one or more, a rate is a rate.
    assert (stored.tokens_per_char, stored.tokens_per_extra_byte, stored.basis) == (
        learnt.tokens_per_char, learnt.tokens_per_extra_byte, learnt.basis)
    # Stored and read back, a later count is solved against the same basis.
    again = SessionRecord.model_validate_json(record.model_dump_json())
    after_store = _count(stored_calibration(again), 3000, 9000)
    in_memory = _count(learnt, 3000, 9000)
    assert after_store.rates == in_memory.rates and after_store.basis == in_memory.basis


def test_a_record_from_before_dense_rates_reads_as_a_ratio_alone() -> None:
    record = SessionRecord(session_id="s", tokens_per_char=0.25)
    cal = stored_calibration(record)
    assert (cal.tokens_per_char, cal.reports, cal.tokens_per_extra_byte) == (0.25, 1, None)
    assert stored_calibration(SessionRecord(session_id="s")) == Calibration()


def test_a_conversation_in_chinese_is_met_before_its_dense_rate_is_known() -> None:
    """One whole count of a prompt mostly in Chinese cannot tell the two rates
    apart, but it fixes what a prompt made up like it costs: a longer one of
    the same make-up is estimated within rounding, not at a cautious rate on
    top of a count that already holds the Chinese; one made up otherwise is
    never under-estimated."""
    first = _count(Calibration(), 3000, 5000)  # 500 ASCII and 2,500 CJK characters
    assert first.tokens_per_extra_byte is None and first.dense_bound is not None
    assert estimate_tokens(6000, first, extra_bytes=10000) == pytest.approx(
        _true_cost(6000, 10000), rel=0.01)
    for chars, extra_bytes in ((6000, 2000), (6000, 11000), (4000, 0), (3000, 5800)):
        assert estimate_tokens(chars, first, extra_bytes=extra_bytes) >= _true_cost(
            chars, extra_bytes)


def test_a_trace_of_chinese_in_a_count_keeps_the_cautious_rate() -> None:
    prose = _count(Calibration(), 8000, 40)
    assert prose.dense_bound is None
    assert estimate_tokens(3000, prose, extra_bytes=6000) > _true_cost(3000, 6000)


def test_a_rate_that_rose_is_stored_and_one_that_fell_a_little_is_not() -> None:
    """A rate stored too low would let an estimate fall short of the truth, so
    any real rise is written; a small fall only leaves the estimate a little
    high, not worth a store and two messages a turn."""
    assert rate_moved(None, 0.25) and not rate_moved(0.25, None)
    assert rate_moved(0.25, 0.25 * 1.01)
    assert not rate_moved(0.25, 0.25 * 1.004)
    assert not rate_moved(0.25, 0.25 * (1 - RATE_FALL_KEPT / 2))
    assert rate_moved(0.25, 0.25 * (1 - RATE_FALL_KEPT * 1.5))
    # Two counts exactly in proportion teach an extra byte to cost nothing.
    assert not rate_moved(0.0, 0.0) and rate_moved(0.0, 0.1)


def test_a_first_basis_is_stored_but_a_newer_one_alone_is_not() -> None:
    first, newer = Sample(1000, 0, 250), Sample(2000, 0, 500)
    assert worth_storing(Calibration(0.25, 1), Calibration(0.25, 2, basis=first))
    assert not worth_storing(Calibration(0.25, 1, basis=first),
                             Calibration(0.25, 2, basis=newer))
    assert worth_storing(Calibration(0.25, 1, basis=first),
                         Calibration(0.25, 2, 0.3, basis=newer))


def test_a_model_window_the_configured_headroom_would_leave_bare_takes_the_default() -> None:
    """OUTPUT_HEADROOM 4096 holds for NUM_CTX 8192; a model trained for 4096
    was left a budget of 1, and every message of its sessions was refused."""
    assert prompt_budget(8192, 4096) == 4096
    assert prompt_budget(4096, 4096) == 4096 - default_headroom(4096)
    assert prompt_budget(4096, 3700) == 4096 - default_headroom(4096)
    assert prompt_budget(4096, 3584) == 512  # leaves exactly the least: kept


def byte_fallback_count(messages: list[dict[str, Any]]) -> int:
    """A 32k-vocabulary tokenizer without Hangul: three byte tokens a syllable."""
    return sum(4 + sum(3 if ord(ch) > 0x7F else 0.25 for ch in message["content"])
               for message in messages)


def test_a_script_costing_more_than_a_token_a_character_is_learnt() -> None:
    """Counts of over one token a character were thrown away as impossible, and
    so was the model's refusal: the estimate stayed at a third of the truth, and
    every later message of the session was refused as too long."""
    messages = [{"role": "user", "content": "안녕하세요 반갑습니다 " * 40}]
    size = prompt_size(messages)
    count = byte_fallback_count(messages)
    learnt = calibrate(Calibration(), count, size.chars, NUM_CTX, messages=size.messages,
                       extra_bytes=size.extra_bytes)
    assert estimate_prompt(messages, learnt) >= count
    refused = refused_as_too_long(Calibration(), size, count - 1)
    assert estimate_prompt(messages, refused) >= count - 1
    # Charged to its dense text, not to every character: English sent next is
    # not taken for several times its size.
    english = [{"role": "user", "content": "hello there, how are you today? " * 60}]
    assert estimate_prompt(english, learnt) < 0.5 * prompt_size(english).chars


def test_a_small_count_teaches_dense_text_no_rate_of_its_own() -> None:
    """A greeting's rounding, charged to its few dense bytes, priced a later
    paste at twice its cost, which was then refused and never counted."""
    greeting = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "안녕하세요 반갑습니다 잘 지내세요 감사합니다 hi"}]
    size = prompt_size(greeting)
    learnt = calibrate(Calibration(), 70, size.chars, NUM_CTX, messages=size.messages,
                       extra_bytes=size.extra_bytes)
    assert learnt.tokens_per_extra_byte is None


def test_dearer_ascii_added_later_does_not_cheapen_dense_text() -> None:
    """Prose with some Chinese, then a code listing: all that was added is
    ASCII of a dearer kind. Solved together, the two counts charged that to
    the character rate and left a Chinese character at under half its cost,
    so a Chinese paste sent next was let through far over the budget."""
    def cost(prose: int, code: int, chinese: int, messages: int) -> int:
        return round(prose * 0.22 + code * 0.34 + chinese * 0.9 + 4 * messages)

    first = calibrate(Calibration(), cost(400, 0, 100, 1), 500, 32768,
                      messages=1, extra_bytes=200)
    then = calibrate(first, cost(400, 3000, 100, 2), 3500, 32768,
                     messages=2, extra_bytes=200)
    paste = estimate_tokens(5000, then, 3, extra_bytes=3200)
    assert paste >= cost(400, 3000, 1600, 3)
