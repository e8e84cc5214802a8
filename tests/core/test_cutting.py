"""Cutting what is too large to send whole: the head kept, a marker counting the rest."""

from __future__ import annotations

import pytest

from schemas.history import ChatMessage
from services.core.cutting import cut_content, cut_text, left_out, longest_fitting_cut


def test_a_cut_keeps_the_head_and_says_how_much_was_left_out() -> None:
    cut = cut_text("a" * 10_000, 100)
    assert cut.startswith("a" * 100) and not cut.startswith("a" * 101)
    assert "9,900 characters left out" in cut
    assert left_out(cut) == 9_900


def test_a_text_that_fits_is_not_touched() -> None:
    assert cut_text("short", 5) == "short"
    assert left_out("short") == 0
    with pytest.raises(ValueError):
        cut_text("x", -1)


def test_cutting_again_counts_everything_left_out() -> None:
    once = cut_text("b" * 1000, 500)
    twice = cut_text(once, 100)
    assert twice.startswith("b" * 100) and left_out(twice) == 900
    assert twice.count("left out") == 1


def test_the_longest_fitting_cut_is_found() -> None:
    text = "c" * 5000
    kept = longest_fitting_cut(text, lambda t: len(t) <= 1000)
    assert kept is not None and len(kept) <= 1000
    assert len(cut_text(text, 5000 - left_out(kept) + 1)) > 1000  # one more would not fit
    assert longest_fitting_cut(text, lambda t: True) == text
    assert longest_fitting_cut(text, lambda t: len(t) < 10) is None  # not even the marker


def test_a_message_keeps_everything_but_its_cut_content() -> None:
    message = ChatMessage(role="tool", tool_name="dump", content="line\n" * 1000, query_id="q")
    cut = cut_content(message, lambda m: len(m.content) <= 300)
    assert cut is not None and len(cut.content) <= 300 and "left out" in cut.content
    assert (cut.role, cut.tool_name, cut.query_id) == ("tool", "dump", "q")
    assert cut_content(message, lambda m: True) is message


def test_a_text_made_to_look_like_a_marker_is_not_a_count() -> None:
    """int() refuses over 4,300 digits: every cut of such a text failed."""
    fake = "x" + "\n[… " + "9" * 5000 + " characters left out here: too long to send whole]"
    assert left_out(fake) == 0
    assert left_out(cut_text(fake, 10)) == len(fake) - 10


@pytest.mark.parametrize("count", [",", ",,,", "9" * 26])
def test_a_marker_without_a_count_is_text(count: str) -> None:
    fake = "x" * 100 + f"\n[… {count} characters left out here: too long to send whole]"
    assert left_out(fake) == 0
    assert left_out(cut_text(fake, 10)) == len(fake) - 10
    assert longest_fitting_cut(fake, lambda text: len(text) < 80) is not None
