from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.rates import Rates, Sample, fit_dominant, plausible, solve

TRUE = Rates(0.25, 0.3)


def counted(chars: float, extra_bytes: float, rates: Rates = TRUE) -> Sample:
    return Sample(chars, extra_bytes, rates.cost(chars, extra_bytes))


def test_two_counts_of_different_make_up_pin_both_rates() -> None:
    solved = solve(counted(4000, 0), counted(3000, 2400))
    assert solved == pytest.approx(TRUE)


@given(st.floats(0.1, 0.9), st.floats(0.0, 0.9), st.integers(1000, 20000),
       st.integers(0, 6000), st.integers(6001, 30000))
def test_any_plausible_rates_are_recovered(per_char: float, per_byte: float, chars: int,
                                           few_bytes: int, many_bytes: int) -> None:
    rates = Rates(per_char, per_byte)
    solved = solve(counted(chars, few_bytes, rates), counted(chars, many_bytes, rates))
    if solved is not None:  # refused only when too alike or too small
        assert solved.per_char == pytest.approx(per_char, abs=1e-6)
        assert solved.per_extra_byte == pytest.approx(per_byte, abs=1e-6)


@pytest.mark.parametrize(
    ("basis", "latest", "why"),
    [
        (counted(4000, 100), counted(4200, 110), "shares of dense bytes too alike"),
        (counted(4000, 0), counted(4000, 0), "the same make-up"),
        (counted(100, 0), counted(80, 300), "too few tokens for rounding not to swamp them"),
        (Sample(4000, 0, 1000), Sample(3000, 2400, 100), "an implausible answer"),
    ],
)
def test_solve_refuses_what_cannot_tell_the_rates_apart(basis: Sample, latest: Sample,
                                                         why: str) -> None:
    assert solve(basis, latest) is None, why


def test_the_rate_fitted_is_the_one_carrying_the_count() -> None:
    known = Rates(0.2, 0.3)
    mostly_text = fit_dominant(counted(4000, 100), known)
    assert mostly_text is not None
    assert mostly_text.per_extra_byte == 0.3
    assert mostly_text.cost(4000, 100) == pytest.approx(TRUE.cost(4000, 100))
    mostly_dense = fit_dominant(Sample(100, 3000, 100 * 0.2 + 3000 * 0.4), known)
    assert mostly_dense == pytest.approx(Rates(0.2, 0.4))


def test_plausible_bounds() -> None:
    assert plausible(1 / 12, 0.0) and plausible(1.0, 1.0)
    assert not plausible(0.05, 0.3) and not plausible(0.3, -0.01) and not plausible(0.3, 1.4)
    # A tokenizer without Hangul: 0.25 an ASCII character, three byte tokens a
    # syllable. Refused as more than a token an extra byte, it was never learnt.
    assert plausible(0.25, 1.375)
    assert solve(counted(4000, 0, Rates(0.25, 1.375)),
                 counted(3000, 2400, Rates(0.25, 1.375))) == pytest.approx(Rates(0.25, 1.375))
