"""Where the compact zone ends, and the structural fallback.

A turn starts at a user message and runs until the next one, so a boundary
placed on a user message can never separate a tool call from its result.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from schemas.history import ChatMessage
from schemas.messages import Level

_ELIDED = re.compile(r"\n\[… \d+ characters of tool output elided\]\Z")


def choose_boundary(messages: Sequence[ChatMessage], tail_turns: int) -> int:
    """Index i: messages[:i] are compacted, messages[i:] (the last turns) stay raw.

    0 means there is nothing to compact: nothing lies before the last
    `tail_turns` turns. Messages before the first user message (no turn of
    their own) belong to the compact zone. No turn kept (0) compacts them all:
    a turn's last resort when the last turn alone leaves it no room.
    """
    if tail_turns < 0:
        raise ValueError(f"tail_turns must be >= 0, got {tail_turns}")
    if tail_turns == 0:
        return len(messages)
    starts = [i for i, m in enumerate(messages) if m.role == "user"]
    if len(starts) < tail_turns:
        return 0
    return starts[-tail_turns]


def tail_turns_for(level: Level, configured: int) -> int:
    """Turns kept raw at this level: fewer as the pressure rises."""
    if configured < 1:
        raise ValueError(f"configured tail turns must be >= 1, got {configured}")
    if level is Level.gentle:
        return configured
    if level is Level.tighter:
        return max(1, configured // 2)
    return 1


def elision_marker(elided_chars: int) -> str:
    return f"\n[… {elided_chars} characters of tool output elided]"


def elide_tool_output(
    messages: Sequence[ChatMessage], keep_last: int, max_chars: int = 200
) -> tuple[ChatMessage, ...]:
    """Shorten old tool results to their first `max_chars` characters plus a marker.

    The last `keep_last` tool results, every user and assistant message, and
    results already elided are left as they are; no message is ever removed.
    """
    if keep_last < 0 or max_chars < 0:
        raise ValueError(f"need keep_last >= 0 and max_chars >= 0, got {keep_last}, {max_chars}")
    tool_indices = [i for i, m in enumerate(messages) if m.role == "tool"]
    older = set(tool_indices[: max(0, len(tool_indices) - keep_last)])
    return tuple(
        _elided(m, max_chars) if i in older else m for i, m in enumerate(messages)
    )


def _elided(message: ChatMessage, max_chars: int) -> ChatMessage:
    content = message.content
    if _ELIDED.search(content):
        return message
    cut = len(content) - max_chars
    shortened = content[:max_chars] + elision_marker(cut)
    # Only elide when it actually saves characters.
    if len(shortened) >= len(content):
        return message
    return message.model_copy(update={"content": shortened})
