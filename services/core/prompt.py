"""The exact messages sent to the model (`text_size` weighs them).

The pinned system prompt is always the first message, byte for byte the same
on every call; compaction never touches it. A summary follows as a second
system message that presents itself as notes on the earlier part of the same,
still running conversation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from schemas.history import ChatMessage, Conversation

# Opens the summary message. It must read as a continuation: framing the notes
# as a fresh start is what makes models greet the user again after compaction.
SUMMARY_PREFIX = (
    "Context notes: the earlier part of this same conversation was condensed "
    "into the notes below to save space. The conversation continues after "
    "them; carry on from where it stands.\n\n"
)

# Made once: `json.dumps` with options builds an encoder on every call, a
# fifth of the time it takes to weigh a tool call.
_COMPACT = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def compact_json(value: Any) -> str:
    """Key-sorted JSON without spaces, so equal structures always weigh the same."""
    return _COMPACT.encode(value)


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """One history message as an Ollama chat message."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"function": {"name": call.name, "arguments": dict(call.arguments)}}
            for call in message.tool_calls
        ]
    if message.tool_name is not None:
        out["tool_name"] = message.tool_name
    return out


def render_messages(
    system: str,
    conversation: Conversation,
    pending: Sequence[ChatMessage] = (),
) -> list[dict[str, Any]]:
    """System prompt, summary, history, then the turn in progress."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    if conversation.summary is not None:
        out.append({"role": "system", "content": SUMMARY_PREFIX + conversation.summary})
    out.extend(message_dict(m) for m in conversation.messages)
    out.extend(message_dict(m) for m in pending)
    return out
