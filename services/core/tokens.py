"""Token estimates calibrated on the provider's own counts.

The estimate is the text's characters times a tokens-per-character ratio
taken from the provider's last trustworthy report, plus a few tokens of
framing per message; before any such report a conservative fallback
over-estimates, so an uncalibrated session compacts early rather than
overflows.

Framing is counted in tokens, not characters, because that is how chat
templates add it (a role header and an end marker per message, whatever the
text's density). Counting it in characters would make the ratio learnt on a
short, framing-heavy prompt too high for the longer prompts that follow. Pass
the number of messages to use it; with 0 the whole prompt is charged at the
ratio, framing and all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.core.prompt import MESSAGE_OVERHEAD_CHARS, sent_chars

# Tokens a chat template adds around each message (Llama 3 and ChatML add 4-5).
FRAMING_TOKENS_PER_MESSAGE = 4

# 2.5 characters per token is denser than almost any real text, so the
# fallback over-estimates until the provider's first usable count arrives.
FALLBACK_TOKENS_PER_CHAR = 1 / 2.5

# Fewer tokens than one per 12 characters means the provider did not count the
# whole prompt (Ollama's KV cache reuse reports only the uncached tokens).
MIN_TOKENS_PER_CHAR = 1 / 12

# Chat text seldom costs more than one token per character, so a count no
# larger than this per character of the new suffix may be of the suffix alone.
MAX_TOKENS_PER_CHAR = 1.0

# A whole-prompt count and a fresh-part-only one are told apart by size only
# when the whole prompt is at least this many times the fresh part.
DISTINGUISHABLE = 2.0
# ...and a count within this factor of the whole prompt's expected count is
# taken for a whole count (the ratio drifts as the content mix changes).
WHOLE_COUNT_TOLERANCE = 1.25

# A count at or above this share of num_ctx was capped by silent truncation.
TRUNCATION_FRACTION = 0.98


@dataclass(frozen=True)
class Calibration:
    tokens_per_char: float | None = None
    reports: int = 0


def calibrate(
    previous: Calibration,
    reported_prompt_tokens: int | None,
    sent_chars: int,
    num_ctx: int,
    *,
    reused_chars: int = 0,
    messages: int = 0,
) -> Calibration:
    """Fold one provider report into the calibration; untrustworthy ones change nothing.

    `reused_chars` is what a prompt cache may have served this call from the
    previous one (`prompt.reusable_chars`); Ollama leaves that part out of its
    count. Pass it: without it, a count of only a large new suffix (a big tool
    result) looks plausible and would make every later estimate too low.
    """
    ratio = _sample(reported_prompt_tokens, sent_chars, num_ctx, reused_chars,
                    previous.tokens_per_char, messages)
    if ratio is None:
        return previous
    # The latest sample wins, no averaging: consecutive prompts share almost
    # all their text, so the last call's ratio is the best predictor of the
    # next; an average would lag behind whenever the content mix changes
    # (say, code-heavy tool output arriving) and lag is what overflows.
    return Calibration(ratio, previous.reports + 1)


def _sample(reported: int | None, sent_chars: int, num_ctx: int, reused_chars: int,
            known: float | None, messages: int) -> float | None:
    """Tokens per character of text this report shows, or None when it shows
    nothing reliable."""
    if reported is None or reported <= 0 or sent_chars <= 0:
        return None
    if reported >= TRUNCATION_FRACTION * num_ctx:
        return None  # capped by truncation
    if reported < sent_chars * MIN_TOKENS_PER_CHAR:
        return None  # counted only what the cache did not hold
    fresh = sent_chars - reused_chars
    # Nothing could come from the cache, or more tokens than MAX_TOKENS_PER_CHAR
    # per fresh character: the count cannot be of the fresh part alone.
    whole = reused_chars <= 0 or fresh <= 0 or reported > fresh * MAX_TOKENS_PER_CHAR
    if not whole and known is not None:
        expected = _expected(sent_chars, known, messages)
        whole = _whole_prompt_count(reported, sent_chars, fresh, expected)
    if not whole:
        return None  # it may count only the fresh part: nothing reliable to learn
    text_tokens = reported - FRAMING_TOKENS_PER_MESSAGE * messages
    if text_tokens <= 0:
        return None  # less than the framing alone: not a count of this prompt
    return text_tokens / _text_chars(sent_chars, messages)


def _text_chars(chars: int, messages: int) -> int:
    return max(1, chars - MESSAGE_OVERHEAD_CHARS * messages)


def _expected(chars: int, ratio: float, messages: int) -> float:
    return _text_chars(chars, messages) * ratio + FRAMING_TOKENS_PER_MESSAGE * messages


def _whole_prompt_count(reported: int, sent_chars: int, fresh: int, expected: float) -> bool:
    """With a ratio already known, a count of the whole prompt lies near
    sent_chars x ratio and a count of the fresh part alone near fresh x ratio.
    Where those are far apart, a count close to the first is a whole count.
    Without this, a session whose every prompt extends the last would keep
    its first ratio for ever, and the first prompt (short, mostly framing) is
    the least representative one."""
    if sent_chars < fresh * DISTINGUISHABLE:
        return False
    return abs(math.log(reported / expected)) <= math.log(WHOLE_COUNT_TOLERANCE)


def estimate_tokens(chars: int, calibration: Calibration, messages: int = 0) -> int:
    """Tokens a prompt of `chars` characters (as `prompt.sent_chars` counts them)
    in `messages` messages is expected to cost with this provider."""
    ratio = calibration.tokens_per_char or FALLBACK_TOKENS_PER_CHAR
    text = max(0, chars - MESSAGE_OVERHEAD_CHARS * messages)
    return math.ceil(text * ratio) + FRAMING_TOKENS_PER_MESSAGE * messages


def budget(num_ctx: int, output_headroom: int) -> int:
    """Prompt tokens a call may use: the window minus the room kept for the reply."""
    if num_ctx < 1 or output_headroom < 0:
        raise ValueError(f"need num_ctx >= 1 and headroom >= 0, got {num_ctx}, {output_headroom}")
    return max(1, num_ctx - output_headroom)


def default_headroom(num_ctx: int) -> int:
    """Tokens reserved for the reply: an eighth of the window, at least 256.

    Ollama's num_ctx holds the prompt and the generated tokens together, so a
    prompt filling the window leaves the model no room to answer. A fraction
    scales from small local windows to 256k ones (a fixed reserve would be
    wasteful on one and too small on the other); the floor keeps a useful
    answer possible in a 2k window.
    """
    return max(256, num_ctx // 8)


def prompt_budget(num_ctx: int, output_headroom: int | None = None) -> int:
    """The budget for a configured headroom, or for the default one when unset."""
    headroom = default_headroom(num_ctx) if output_headroom is None else output_headroom
    return budget(num_ctx, headroom)


def estimate_prompt(messages: Sequence[Mapping[str, Any]], calibration: Calibration,
                    tools: Sequence[Mapping[str, Any]] = ()) -> int:
    """Tokens these rendered messages (and tools) are expected to cost."""
    return estimate_tokens(sent_chars(messages, tools), calibration, len(messages))
