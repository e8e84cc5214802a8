"""The model's `recall` search over a session's transcript: messages
holding every word of a query, newest first, found as the transcript is
read without holding more than the matches asked for."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import Any

from services.core.transcript import Item

# Scripts written without spaces between words (Thai, Lao, Tibetan, Myanmar,
# Khmer, Chinese, Japanese; and Hangul, whose spaced words take endings):
# `\w+` made a clause of them one word, so a query word of them is looked for
# inside the text instead, and a run of them is a word apart from the letters
# and digits beside it.
_UNSPACED_CHARS = ("\u0e00-\u0fff\u1000-\u109f\u1780-\u17ff\u2e80-\u2fff\u3040-\u9fff"
                   "\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f")
_UNSPACED = re.compile(f"[{_UNSPACED_CHARS}]")
_WORD = re.compile(f"[{_UNSPACED_CHARS}]+|[^\\W{_UNSPACED_CHARS}]+")


def recall(items: Iterable[Item], query: str, limit: int, own_tool: str | None = None
           ) -> list[Item]:
    """Messages holding every word of `query` (case-insensitive), newest first."""
    search = Recall(query, limit, own_tool)
    search.take(items)
    return search.found()


class Recall:
    """`recall`, fed as the transcript is read: only the `limit` newest
    matches are ever held, however long the transcript. The calls of
    `own_tool` (the tool doing this search) and their results are never
    matches: each holds the query, and, newest, they crowded out what was said."""

    def __init__(self, query: str, limit: int, own_tool: str | None = None) -> None:
        words = {w.casefold() for w in _WORD.findall(query)}
        self._parts = {w for w in words if _UNSPACED.search(w)}
        self._words = words - self._parts
        self._own_tool = own_tool
        self._found: deque[Item] = deque(maxlen=max(limit, 0))

    def take(self, items: Iterable[Item]) -> None:
        if self._words or self._parts:
            self._found.extend(i for i in items if i.kind == "message" and self._holds(i.body))

    def found(self) -> list[Item]:
        return list(reversed(self._found))

    def _holds(self, body: dict[str, Any]) -> bool:
        if self._own_tool is not None and body.get("tool_name") == self._own_tool:
            return False
        text = str(body.get("content", ""))
        text += " ".join(f" {c['name']} {c['arguments']}" for c in body.get("tool_calls", [])
                         if c["name"] != self._own_tool)
        folded = text.casefold()
        return (self._words <= {w.casefold() for w in _WORD.findall(text)}
                and all(part in folded for part in self._parts))
