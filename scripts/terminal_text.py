"""Text from a model, a document or the bus, made safe to print to a terminal."""

from __future__ import annotations

import re

# C0 controls but newline and tab, DEL, and C1 controls: escape sequences start
# with them (ESC, CSI), and a terminal obeys them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def shown(text: str) -> str:
    """`text` with each control character made visible, one character for one
    (a C0 one as its Unicode control picture, others as U+FFFD): a model's
    answer or a pasted page cannot clear the screen, retitle the window or
    write the clipboard. Printed text is text, as on the page."""
    return _CONTROL.sub(_visible, text)


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return chr(0x2400 + code) if code < 0x20 else "\ufffd"
