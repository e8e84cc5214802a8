"""How much of a call the model server's prompt cache may have served.

Ollama keeps the tokens of the previous call and reuses their longest common
prefix with the next one; its `prompt_eval_count` then counts only the rest.
A calibration that took such a count for the whole prompt would learn a
ratio far too low, so each count goes with the size of the part that may
have been cached: the longest common prefix, in messages, with the previous
call of the session.

That previous call is read off the durable history, not remembered by the
process that sent it, so any generator (or one restarted) knows it: the last
turn's final call sent everything the history now holds but that turn's
answer. A snapshot written since (a compaction) replaced the summary, so only
the pinned system prompt can still be shared. Within a turn, the call before
is the turn's own previous round of the tool loop. Nothing of it needs to be
kept per session.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from schemas.history import Conversation
from services.core.prompt import render_messages
from services.core.text_size import Size, leading_size, prompt_size

Messages = Sequence[Mapping[str, Any]]


def previous_call(system: str, conversation: Conversation,
                  called_before: bool = False) -> list[dict[str, Any]]:
    """The messages of the session's last call that this history shows, as far
    as a later call can share them ([] when no call was built on it).
    `called_before`: the session has made a call (it is calibrated), whose
    pinned system prompt the server may still hold though no turn was stored
    (the turn failed after its call)."""
    if conversation.just_compacted:
        # A compaction since: at most the pinned system prompt is shared.
        return [{"role": "system", "content": system}] if system else []
    if not conversation.messages:
        if called_before and system:
            return [{"role": "system", "content": system}]
        # No turn stored: the session has made no call we know of. (Another
        # session's call with the same system prompt may have left it
        # cached; the plausibility floor catches the largest such counts.)
        return []
    return render_messages(system, conversation)[:-1]  # all but the last turn's answer


def common_prefix(previous: Messages, current: Messages) -> int:
    """How many leading messages the two calls share, byte for byte."""
    count = 0
    for before, now in zip(previous, current, strict=False):
        if before != now:
            break
        count += 1
    return count


def cached_size(previous: Messages, current: Messages,
                tools: Sequence[Mapping[str, Any]] = (), whole: Size | None = None) -> Size:
    """The part of `current` a prefix cache holding `previous` may have served
    (the tools with it: they are the same on every call of a process).
    `whole`, the size of `current` with `tools` when known, spares weighing
    the shared part again: only the rest is."""
    shared = common_prefix(previous, current)
    if whole is None or shared == 0:
        return leading_size(current, shared, tools)
    return whole - prompt_size(current[shared:])
