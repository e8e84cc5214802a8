"""Cutting a text too large to send whole, with a marker that says so.

A prompt must never go over the window, and Ollama would cut an oversized
one from the front without a word. So the one thing too large to send (a
huge tool result, one message of a compact zone) is cut here instead: its
head is kept, and a marker says how many characters were left out. Nothing
is ever dropped silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from schemas.history import ChatMessage

# A digit, then at most 24 digits and commas: a count, not text made to look
# like one (int() refuses a number of over 4,300 digits, and commas alone).
_MARKER = re.compile(r"\n\[… (\d[\d,]{0,24}) characters left out here: too long to send whole\]\Z")


def cut_marker(left_out: int) -> str:
    return f"\n[… {left_out:,} characters left out here: too long to send whole]"


def left_out(text: str) -> int:
    """Characters an earlier cut left out of `text` (0 when it was never cut)."""
    found = _MARKER.search(text)
    return int(found.group(1).replace(",", "")) if found else 0


def cut_text(text: str, keep_chars: int) -> str:
    """The first `keep_chars` characters of `text` and a marker counting the rest.

    A text cut before is cut again from its original part, and the marker
    counts everything left out, both times."""
    if keep_chars < 0:
        raise ValueError(f"keep_chars must be >= 0, got {keep_chars}")
    earlier = left_out(text)
    body = _MARKER.sub("", text) if earlier else text
    if keep_chars >= len(body):
        return text
    return body[:keep_chars] + cut_marker(earlier + len(body) - keep_chars)


def longest_fitting_cut(text: str, fits: Callable[[str], bool]) -> str | None:
    """`text` itself if `fits` accepts it, else its longest cut that does, or
    None when not even the marker alone fits. `fits` must be monotonic: what
    fits still fits when shortened."""
    if fits(text):
        return text
    if not fits(cut_text(text, 0)):
        return None
    low, high = 0, len(_MARKER.sub("", text)) - 1  # `low` always fits
    while low < high:
        middle = (low + high + 1) // 2
        if fits(cut_text(text, middle)):
            low = middle
        else:
            high = middle - 1
    return cut_text(text, low)


def cut_content(message: ChatMessage, fits: Callable[[ChatMessage], bool]) -> ChatMessage | None:
    """The message with as much of its content as `fits` accepts (see
    `longest_fitting_cut`); None when even an empty content does not fit."""
    def with_content(content: str) -> ChatMessage:
        if content == message.content:
            return message
        return message.model_copy(update={"content": content})

    kept = longest_fitting_cut(message.content, lambda content: fits(with_content(content)))
    return None if kept is None else with_content(kept)
