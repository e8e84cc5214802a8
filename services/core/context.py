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
from typing import Any

from schemas.history import Conversation
from services.core.prompt import SUMMARY_PREFIX, render_messages
from services.core.text_size import MESSAGE_OVERHEAD_CHARS, Size, prompt_size
from services.core.tokens import Calibration, default_headroom, estimate_size, estimate_tokens


def next_prompt_size(system: str, conversation: Conversation,
                     tools: Sequence[Mapping[str, Any]] = ()) -> Size:
    """The next call's prompt without a new user message, tools included."""
    return prompt_size(render_messages(system, conversation), tools)


def context_tokens(size: Size, calibration: Calibration) -> int:
    """Tokens in the context: the calibrated estimate of a prompt of this size."""
    return estimate_size(size, calibration)


def part_tokens(whole: Size, chars: int, calibration: Calibration) -> int:
    """Tokens in `chars` characters of a prompt of size `whole` (what a
    compaction replaces, the summary), taken to be made up as the whole is:
    a report gives such parts in characters alone, and a dense script's
    cost lies in its bytes."""
    return context_tokens(whole.part(chars), calibration)


def next_prompt_tokens(system: str, conversation: Conversation,
                       tools: Sequence[Mapping[str, Any]], calibration: Calibration) -> int:
    """Tokens in the context of a session with this history and these tools."""
    return context_tokens(next_prompt_size(system, conversation, tools), calibration)


def summary_allowance(num_ctx: int, calibration: Calibration) -> int:
    """The most tokens the summary message a compaction writes may take.

    The summariser writes within the reply room of its window (`pieces.
    SummaryWindow`: an eighth of it), whatever room the session keeps for its
    own answers: priced at a large OUTPUT_HEADROOM, no compaction looked worth
    asking for and every one came as an emergency inside a turn. The message
    also carries the fixed prefix that presents it as notes. (A summary cut at
    that room is written again with more, up to half the window: a bound too
    rare to price every compaction at.) A compaction's relief is what it
    removes less this, never less: counting the new summary as free is how a
    compaction that only rewrites the notes looked worth making.
    """
    framing = estimate_tokens(len(SUMMARY_PREFIX) + MESSAGE_OVERHEAD_CHARS, calibration, 1)
    return default_headroom(num_ctx) + framing
