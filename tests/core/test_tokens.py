from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.core.tokens import (
    FALLBACK_TOKENS_PER_CHAR,
    Calibration,
    budget,
    calibrate,
    default_headroom,
    estimate_tokens,
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


def test_just_plausible_and_just_below_the_cap_are_used() -> None:
    assert calibrate(PRIOR, 834, 10000, NUM_CTX).reports == 4
    below_cap = math.ceil(0.98 * NUM_CTX) - 1
    assert calibrate(PRIOR, below_cap, 4 * below_cap, NUM_CTX).tokens_per_char == 0.25


def test_a_count_that_may_cover_only_the_new_suffix_is_ignored() -> None:
    # 10000 chars sent, extending a 6000-char previous prompt a cache may have
    # served. 3000 tokens looks plausible for 10000 chars, but it is also under
    # one token per fresh character: it may count only the 4000-char suffix.
    assert calibrate(PRIOR, 3000, 10000, NUM_CTX, reused_chars=6000) is PRIOR
    assert calibrate(PRIOR, 4000, 10000, NUM_CTX, reused_chars=6000) is PRIOR
    # More tokens than fresh characters cannot be a suffix-only count.
    assert calibrate(PRIOR, 4100, 10000, NUM_CTX, reused_chars=6000) == Calibration(0.41, 4)
    # Nothing fresh (identical prompt) or nothing reusable: the plain rules apply.
    assert calibrate(PRIOR, 3000, 10000, NUM_CTX, reused_chars=10000).reports == 4
    assert calibrate(PRIOR, 3000, 10000, NUM_CTX, reused_chars=0).reports == 4


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


@settings(max_examples=200, deadline=None)
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
    assert out.tokens_per_char == reported / sent
    # What is accepted is plausible, was not truncated, and cannot be a suffix
    # count, or lies close to the whole prompt's expected count while the fresh
    # part is at most half the prompt.
    assert reported * 12 >= sent
    assert reported < 0.98 * num_ctx
    fresh = sent - reused
    certainly_whole = reused <= 0 or reused >= sent or reported > fresh
    assert PRIOR.tokens_per_char is not None
    near_whole = (sent >= 2 * fresh
                  and abs(math.log(reported / (sent * PRIOR.tokens_per_char))) <= math.log(1.25))
    assert certainly_whole or near_whole


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
    third too low. Told what was reusable, calibrate keeps the previous ratio.
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
    # After a compaction nothing is reusable: the count is complete.
    assert calibrate(truth, 750, 3000, NUM_CTX, reused_chars=0) == Calibration(0.25, 2)


def test_a_whole_count_near_the_expected_one_moves_a_stale_ratio() -> None:
    """Every prompt extends the last (the common case), and the first ratio came
    from a short prompt that was mostly framing: a count close to what the whole
    prompt should cost is a whole count, and the ratio follows it."""
    first = Calibration(0.17, 1)
    whole = calibrate(first, 700, 5000, NUM_CTX, reused_chars=4000)
    assert whole == Calibration(700 / 5000, 2)
    # Far from the whole prompt's expected 850 tokens: left alone.
    assert calibrate(first, 300, 5000, NUM_CTX, reused_chars=4000) is first
    # The fresh part is more than half the prompt: too close to call.
    assert calibrate(first, 800, 5000, NUM_CTX, reused_chars=2000) is first
    # With no ratio yet there is nothing to compare with.
    assert calibrate(Calibration(), 700, 5000, NUM_CTX, reused_chars=4000) == Calibration()
