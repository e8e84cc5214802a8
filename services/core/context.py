"""Tokens in the context: the one number the product shows and decides on.

It is the calibrated estimate of the session's next prompt as a call would
send it: the pinned system prompt, the summary, the history and the offered
tool definitions. The page's gauge, `GET /api/sessions/{id}`, a compaction's
`tokens_before` / `tokens_after` and the decider's estimate all come from
`context_tokens`, so they cannot disagree (counting the tools in one place
and not in another made a compaction report a different "before" than the
gauge showed).

The same module sizes what a compaction can free: the messages before the
live zone and the summary it replaces, less the summary it writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.history import Conversation
from services.core.prompt import MESSAGE_OVERHEAD_CHARS, SUMMARY_PREFIX, HistoryWeights, tools_chars
from services.core.tokens import Calibration, estimate_tokens


@dataclass(frozen=True)
class PromptSize:
    """What a prompt weighs before calibration: characters as sent, and messages."""

    chars: int
    messages: int


def next_prompt_size(system: str, conversation: Conversation,
                     tools: Sequence[Mapping[str, Any]] = ()) -> PromptSize:
    """The next call's prompt without a new user message, tools included."""
    weights = HistoryWeights.of(system, conversation)
    return PromptSize(weights.next_prompt + tools_chars(tools), weights.next_prompt_messages)


def context_tokens(size: PromptSize, calibration: Calibration) -> int:
    """Tokens in the context: the calibrated estimate of a prompt of this size."""
    return estimate_tokens(size.chars, calibration, size.messages)


def next_prompt_tokens(system: str, conversation: Conversation,
                       tools: Sequence[Mapping[str, Any]], calibration: Calibration) -> int:
    """Tokens in the context of a session with this history and these tools."""
    return context_tokens(next_prompt_size(system, conversation, tools), calibration)


def summary_allowance(num_ctx: int, budget: int, calibration: Calibration) -> int:
    """The most tokens the summary message a compaction writes may take.

    The summariser's answer has the window's reply room (`num_ctx - budget`)
    to be written in, so no summary is longer; its message also carries the
    fixed prefix that presents it as notes. A compaction's relief is what it
    removes less this, never less: counting the new summary as free is how a
    compaction that only rewrites the notes looked worth making.
    """
    framing = estimate_tokens(len(SUMMARY_PREFIX) + MESSAGE_OVERHEAD_CHARS, calibration, 1)
    return max(0, num_ctx - budget) + framing
