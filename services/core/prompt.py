"""The exact messages sent to the model, and how many characters they weigh.

The pinned system prompt is always the first message, byte for byte the same
on every call; compaction never touches it. A summary follows as a second
system message that presents itself as notes on the earlier part of the same,
still running conversation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.history import ChatMessage, Conversation

# Opens the summary message. It must read as a continuation: framing the notes
# as a fresh start is what makes models greet the user again after compaction.
SUMMARY_PREFIX = (
    "Context notes: the earlier part of this same conversation was condensed "
    "into the notes below to save space. The conversation continues after "
    "them; carry on from where it stands.\n\n"
)

# Characters charged per message for its role and template framing (the chat
# template wraps every message in a few special tokens).
MESSAGE_OVERHEAD_CHARS = 16


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


def message_chars(message: Mapping[str, Any]) -> int:
    """Characters one rendered message contributes to a call."""
    return _chars(message.get("content") or "", message.get("tool_name") or "",
                  message.get("tool_calls"))


def _chars(content: str, tool_name: str, tool_calls: Any) -> int:
    chars = len(content) + MESSAGE_OVERHEAD_CHARS + len(tool_name)
    return chars + len(compact_json(tool_calls)) if tool_calls else chars


def tools_chars(tools: Sequence[Mapping[str, Any]]) -> int:
    """Characters of the tool definitions offered with a call (0 when none)."""
    return len(compact_json(list(tools))) if tools else 0


def sent_chars(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()
) -> int:
    """Characters a call sends: every message with its framing, plus the tools."""
    return sum(message_chars(m) for m in messages) + tools_chars(tools)


def history_chars(messages: Sequence[ChatMessage]) -> int:
    """Characters of history messages as they would be sent."""
    return running_chars(messages)[-1]


def running_chars(messages: Sequence[ChatMessage]) -> list[int]:
    """`out[i]`: characters of `messages[:i]` as sent, for every i in one pass
    (what any prefix of the history weighs, without rendering it again)."""
    out = [0]
    for message in messages:
        # As message_chars(message_dict(message)), without rendering a dict
        # for every message of the history on every turn.
        calls = message_dict(message)["tool_calls"] if message.tool_calls else None
        out.append(out[-1] + _chars(message.content, message.tool_name or "", calls))
    return out


@dataclass(frozen=True)
class HistoryWeights:
    """What a session's next prompt weighs, from one pass over its history."""

    head: int  # the system prompt and the summary
    summary: int
    running: tuple[int, ...]  # running[i]: the first i messages
    head_messages: int

    @classmethod
    def of(cls, system: str, conversation: Conversation) -> HistoryWeights:
        without_messages = Conversation(summary=conversation.summary)
        head = render_messages(system, without_messages)
        summary = render_messages("", without_messages)
        return cls(sent_chars(head), sent_chars(summary),
                   tuple(running_chars(conversation.messages)), len(head))

    @property
    def next_prompt(self) -> int:
        return self.head + self.running[-1]

    @property
    def next_prompt_messages(self) -> int:
        return self.head_messages + len(self.running) - 1

    def compactable(self, boundary: int) -> int:
        """Characters before `boundary`, the summary included: what a
        compaction could free."""
        return self.summary + self.running[boundary]

