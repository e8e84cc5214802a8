"""Where a retried answer goes: after the session's last user message, in
place of the answer written to it (if any)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.history import ChatMessage, Conversation
from schemas.messages import ErrorCode

NOTHING_TO_RETRY = ("the session has no user message left to answer again (none yet, or "
                    "folded into the summary)")
RETRY_OUTDATED = "the session's last message changed since the retry was asked for; retry again"
ANSWER_REPLACED = ("the answer to retry was replaced since the retry was asked for (another "
                   "retry, from another tab?); retry again")


@dataclass(frozen=True)
class RetryPoint:
    # The conversation up to and including the last user message: what the
    # fresh answer is written on.
    context: Conversation
    # The query whose answer the fresh one replaces; None if it has none.
    supersedes: str | None


@dataclass(frozen=True)
class RetryRefused:
    code: ErrorCode
    message: str


def retry_verdict(conversation: Conversation, asked_for: str | None = None,
                  replacing: str | None = None) -> RetryPoint | RetryRefused:
    """Where a retry goes, or why it cannot. `asked_for`: the user message
    the retry was asked for, when known; another answered since outdates it.
    `replacing`: the answer it was asked to replace ("" for none), when
    known; another in its place outdates it too, so two retries asked at
    once of the same answer replace it once."""
    point = retry_point(conversation)
    if point is None:
        return RetryRefused(ErrorCode.nothing_to_retry, NOTHING_TO_RETRY)
    if asked_for is not None and point.context.messages[-1].content != asked_for:
        return RetryRefused(ErrorCode.retry_outdated, RETRY_OUTDATED)
    if replacing is not None and (point.supersedes or "") != replacing:
        return RetryRefused(ErrorCode.retry_outdated, ANSWER_REPLACED)
    return point


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
