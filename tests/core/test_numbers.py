from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.core.numbers import LARGEST, whole_number


@pytest.mark.parametrize("text", ["", " 1", "1 ", "+1", "-1", "1.0", "1e3", "²", "١",
                                  "9" * 20, "9" * 5000, str(LARGEST + 1)])
def test_anything_but_a_few_ascii_digits_is_refused(text: str) -> None:
    assert whole_number(text) is None


def test_the_bounds_are_inclusive() -> None:
    assert whole_number("1", 1, 3) == 1 and whole_number("3", 1, 3) == 3
    assert whole_number("0", 1, 3) is None and whole_number("4", 1, 3) is None
    assert whole_number(str(LARGEST)) == LARGEST


@given(st.integers(min_value=0, max_value=LARGEST))
def test_every_number_in_range_reads_back(value: int) -> None:
    assert whole_number(str(value)) == value
