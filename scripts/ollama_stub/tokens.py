"""Token counting and truncation: the deterministic tokenizer of the stand-in and
the silent dropping of the oldest messages that Ollama does when a prompt exceeds
``num_ctx``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .common import ChatMessage, canonical_json

# Every chat message costs a few template tokens on top of its text, like real chat templates.
PER_MESSAGE_OVERHEAD = 4
# A CJK character costs 0.6-0.8 tokens on Llama 3 and Qwen tokenizers.
DENSE_TOKENS_PER_CHAR = 0.7
_NOT_DENSE = re.compile("[\x00-\u07ff]+")
_NOT_TWO_BYTE = re.compile("[^\u0080-\u07ff]+")


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes to the prompt: content, tool calls, thinking."""
    text = str(message.get("content") or "")
    tool_calls = message.get("tool_calls")
    if tool_calls:
        text += canonical_json(tool_calls)
    return text + str(message.get("thinking") or "")


def count_text_tokens(text: str, chars_per_token: float) -> int:
    """``chars_per_token`` ASCII characters make a token; other scripts are
    denser, as on real tokenizers: a character of two UTF-8 bytes (Greek,
    Cyrillic, Arabic) costs twice an ASCII one, and one of three or four
    (CJK, kana, Hangul) DENSE_TOKENS_PER_CHAR."""
    if text.isascii():
        return math.ceil(len(text) / chars_per_token)
    dense = len(_NOT_DENSE.sub("", text))
    two_byte = len(_NOT_TWO_BYTE.sub("", text))
    sparse = len(text) - dense + two_byte
    return math.ceil(sparse / chars_per_token + dense * DENSE_TOKENS_PER_CHAR)


def count_message_tokens(message: Mapping[str, Any], chars_per_token: float) -> int:
    return count_text_tokens(message_text(message), chars_per_token) + PER_MESSAGE_OVERHEAD


def count_tools_tokens(tools: Sequence[Any] | None, chars_per_token: float) -> int:
    return count_text_tokens(canonical_json(list(tools)), chars_per_token) if tools else 0


def count_prompt_tokens(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    chars_per_token: float,
) -> int:
    """Deterministic prompt size: per message ceil(chars/cpt)+4, plus the offered tools."""
    total = sum(count_message_tokens(message, chars_per_token) for message in messages)
    return total + count_tools_tokens(tools, chars_per_token)


def count_completion_tokens(
    content: str,
    thinking: str,
    tool_calls: Sequence[Any] | None,
    chars_per_token: float,
) -> int:
    """Generated tokens; never zero, because a real model always emits at least EOS."""
    text = content + thinking + (canonical_json(list(tool_calls)) if tool_calls else "")
    return max(1, count_text_tokens(text, chars_per_token))


def truncate_to_fit(
    messages: Sequence[ChatMessage],
    tools: Sequence[Any] | None,
    num_ctx: int,
    chars_per_token: float,
) -> tuple[list[ChatMessage], int]:
    """Drop the oldest messages until the prompt fits ``num_ctx``, as Ollama silently does.

    Returns the kept messages and their token count. The newest message is always kept;
    if even it does not fit, the count is clamped to ``num_ctx`` because Ollama cuts the
    input tokens themselves rather than failing.
    """
    kept = list(messages)
    total = count_prompt_tokens(kept, tools, chars_per_token)
    while total > num_ctx and len(kept) > 1:
        total -= count_message_tokens(kept.pop(0), chars_per_token)
    return kept, min(total, num_ctx)
