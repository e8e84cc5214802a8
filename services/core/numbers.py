"""Whole numbers read from text a caller sent (a query parameter, a cursor).

Python's `int()` refuses a string of more than 4,300 digits with a bare
`ValueError`, which a handler would turn into a 500; and a sequence past
JetStream's 64 bits would reach the server. So the length is checked first.
"""

from __future__ import annotations

# Enough for every value below 2**63, the largest a JetStream sequence takes.
MAX_DIGITS = 19
LARGEST = 2**63 - 1


def whole_number(text: str, low: int = 0, high: int = LARGEST) -> int | None:
    """The number `text` spells in ASCII digits, if it lies in `low..high`;
    None for anything else (a sign, a space, a non-ASCII digit, too many)."""
    if not (text.isascii() and text.isdigit()) or len(text) > MAX_DIGITS:
        return None
    value = int(text)
    return value if low <= value <= high else None
