"""What a prompt weighs in the two measures the token estimate needs.

Characters alone misjudge dense scripts: a Chinese, Japanese or Korean
character costs two to four times the tokens of a Latin letter on common
tokenizers. The UTF-8 bytes a character takes beyond its first tell the
scripts apart: none for ASCII (prose, code, JSON), one for Greek, Cyrillic,
Arabic or Hebrew, two for CJK, kana and Hangul. Estimates charge each
measure at a rate of its own (`tokens.Calibration`). Bytes are also a hard
ceiling: a byte-level tokenizer never makes more tokens than bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.core.prompt import MESSAGE_OVERHEAD_CHARS, compact_json


@dataclass(frozen=True)
class Size:
    """Characters (as `prompt.sent_chars` counts them, framing included),
    UTF-8 bytes beyond one per character, and messages."""

    chars: int = 0
    extra_bytes: int = 0
    messages: int = 0

    def __add__(self, other: Size) -> Size:
        return Size(self.chars + other.chars, self.extra_bytes + other.extra_bytes,
                    self.messages + other.messages)

    def part(self, chars: int) -> Size:
        """A part of this text of `chars` characters, taken to be made up as
        the whole is: its share of the extra bytes and of the messages. What
        a report says in characters alone (what a compaction frees) is then
        priced as dense text costs, by its bytes."""
        if chars <= 0 or self.chars <= 0:
            return Size(max(0, chars))
        share = min(1.0, chars / self.chars)
        return Size(chars, round(self.extra_bytes * share), round(self.messages * share))

    def __sub__(self, other: Size) -> Size:
        return Size(max(0, self.chars - other.chars),
                    max(0, self.extra_bytes - other.extra_bytes),
                    max(0, self.messages - other.messages))

    @property
    def bytes(self) -> int:
        return self.chars + self.extra_bytes


def extra_bytes(text: str) -> int:
    """UTF-8 bytes of `text` beyond one per character (0 for ASCII)."""
    if text.isascii():
        return 0
    # surrogatepass: a lone surrogate in a message must not break the estimate.
    return len(text.encode("utf-8", "surrogatepass")) - len(text)


def _weigh(messages: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """Characters (framing included) and extra bytes of rendered messages.
    One loop with nothing made per message: every turn weighs its whole
    prompt several times, and a profile of long sessions found this the
    generator's largest own cost when it built a Size per message."""
    chars = extra = count = 0
    for message in messages:
        count += 1
        content = message.get("content") or ""
        tool_name = message.get("tool_name") or ""
        chars += len(content) + len(tool_name)
        if not content.isascii():
            extra += extra_bytes(content)
        if not tool_name.isascii():
            extra += extra_bytes(tool_name)
        tool_calls = message.get("tool_calls")
        if tool_calls:
            calls = compact_json(tool_calls)  # the costliest step: once per message
            chars += len(calls)
            extra += extra_bytes(calls)
    return chars + count * MESSAGE_OVERHEAD_CHARS, extra


def tools_size(tools: Sequence[Mapping[str, Any]]) -> Size:
    """The offered tools (no messages of their own)."""
    if not tools:
        return Size()
    text = compact_json(list(tools))  # as `prompt.tools_chars` counts them
    return Size(len(text), extra_bytes(text), 0)


def prompt_size(messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] = ()) -> Size:
    """The size of a call: every message with its framing, plus the tools."""
    return leading_size(messages, len(messages), tools) if messages else tools_size(tools)


def leading_size(messages: Sequence[Mapping[str, Any]], count: int,
                 tools: Sequence[Mapping[str, Any]] = ()) -> Size:
    """The size of the first `count` messages, with the tools when count > 0
    (templates render them ahead of the conversation, or a cache holds them
    with it)."""
    if count <= 0:
        return Size()
    head = messages[:count]
    chars, extra = _weigh(head)
    return tools_size(tools) + Size(chars, extra, len(head))
