"""Where a retried answer goes: after the session's last user message, in
place of the answer written to it (if any)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.history import ChatMessage, Conversation


@dataclass(frozen=True)
class RetryPoint:
    # The conversation up to and including the last user message: what the
    # fresh answer is written on.
    context: Conversation
    # The query whose answer the fresh one replaces; None if it has none.
    supersedes: str | None


def retry_point(conversation: Conversation) -> RetryPoint | None:
    """None when no user message is left to answer again (none yet, or all
    folded into the summary by a compaction)."""
    messages = conversation.messages
    last_user = _last_user_index(messages)
    if last_user is None:
        return None
    answer = messages[last_user + 1:]
    supersedes = answer[0].query_id if answer else None
    context = conversation.model_copy(update={"messages": messages[:last_user + 1]})
    return RetryPoint(context, supersedes)


def _last_user_index(messages: tuple[ChatMessage, ...]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == "user":
            return index
    return None
