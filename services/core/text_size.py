"""What a prompt weighs in the two measures the token estimate needs: the one
place a prompt, a history or a part of either is weighed.

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

from schemas.history import ChatMessage, Conversation
from services.core.prompt import compact_json, message_dict, render_messages

# Characters charged per message for its role and template framing (the chat
# template wraps every message in a few special tokens).
MESSAGE_OVERHEAD_CHARS = 16


@dataclass(frozen=True)
class Size:
    """Characters (framing included), UTF-8 bytes beyond one per character,
    and messages."""

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


def message_weight(content: str, tool_name: str, tool_calls: Any) -> tuple[int, int]:
    """Characters (framing included) and extra bytes of one message, from its
    parts as rendered: the measure every weighing here adds up."""
    chars = len(content) + len(tool_name) + MESSAGE_OVERHEAD_CHARS
    # Tested inline: nearly all text is ASCII, and this runs for every message.
    extra = 0 if content.isascii() else extra_bytes(content)
    if not tool_name.isascii():
        extra += extra_bytes(tool_name)
    if tool_calls:
        calls = compact_json(tool_calls)  # the costliest step: once per message
        chars += len(calls)
        extra += extra_bytes(calls)
    return chars, extra


def _weigh(messages: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """Characters (framing included) and extra bytes of rendered messages.
    Nothing is made per message but its weight: every turn weighs its whole
    prompt several times, and a profile of long sessions found this the
    generator's largest own cost when it built a Size per message."""
    chars = extra = 0
    for message in messages:
        more_chars, more_extra = message_weight(message.get("content") or "",
                                                message.get("tool_name") or "",
                                                message.get("tool_calls"))
        chars += more_chars
        extra += more_extra
    return chars, extra


def tools_size(tools: Sequence[Mapping[str, Any]]) -> Size:
    """The offered tools (no messages of their own)."""
    if not tools:
        return Size()
    text = compact_json(list(tools))
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


def history_weights(messages: Sequence[ChatMessage]) -> tuple[list[int], int]:
    """`running[i]`: characters of `messages[:i]` as sent, for every i; and
    the extra bytes of them all. One pass, without rendering a dict for
    every message of the history on every turn."""
    running, extra = [0], 0
    for message in messages:
        calls = message_dict(message)["tool_calls"] if message.tool_calls else None
        chars, more_extra = message_weight(message.content, message.tool_name or "", calls)
        running.append(running[-1] + chars)
        extra += more_extra
    return running, extra


@dataclass(frozen=True)
class HistoryWeights:
    """What a session's next prompt weighs, from one pass over its history."""

    head: Size  # the system prompt and the summary
    summary: int
    running: tuple[int, ...]  # running[i]: the characters of the first i messages
    messages_extra_bytes: int

    @classmethod
    def of(cls, system: str, conversation: Conversation) -> HistoryWeights:
        without_messages = Conversation(summary=conversation.summary)
        head = prompt_size(render_messages(system, without_messages))
        summary = prompt_size(render_messages("", without_messages)).chars
        running, extra = history_weights(conversation.messages)
        return cls(head, summary, tuple(running), extra)

    @property
    def next_prompt(self) -> int:
        return self.head.chars + self.running[-1]

    @property
    def next_prompt_messages(self) -> int:
        return self.head.messages + len(self.running) - 1

    def next_prompt_size(self, tools: Sequence[Mapping[str, Any]] = ()) -> Size:
        """As `context.next_prompt_size` weighs the prompt rendered anew."""
        whole = Size(self.next_prompt, self.head.extra_bytes + self.messages_extra_bytes,
                     self.next_prompt_messages)
        return whole + tools_size(tools)

    def compactable(self, boundary: int) -> int:
        """Characters before `boundary`, the summary included: what a
        compaction could free."""
        return self.summary + self.running[boundary]
