"""What a session's history is made of.

One JetStream message on `history.<session>` holds one `HistoryEntry`: either
every message of one turn (the user's message, tool calls and results, the
answer), written at once when the turn ends so no reader ever sees half a
turn, or a snapshot written by a compaction splice. Nothing is ever replaced:
the subject is the session's transcript. Folding the entries from the latest
snapshot on gives the `Conversation` the generator sends to the model (the
context); each turn names that snapshot's sequence (`base`), so a reader finds
it from the subject's last message alone, whatever the transcript's length.

The system prompt is deliberately absent: it is pinned in the session's
metadata and prepended on every call, so no compaction can drop or alter it.

Entries are read leniently and written sparingly: a field this version does
not know (a later one's) is passed over, not a reason to skip the entry, and
an optional field added since is written only when it holds something. Only
the generator writes here; an entry a reader skipped would be a turn that a
redelivered query answers again and a compaction leaves out.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.envelope import Timestamp
from schemas.messages import Reply

# How many superseded retries a conversation remembers (see `Conversation`).
KEPT_SUPERSEDED = 64


def _unset(value: object) -> bool:
    return value is None


class Stored(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ToolCall(Stored):
    name: str = Field(min_length=1, max_length=128)
    arguments: dict[str, Any] = Field(default_factory=dict)


Role = Literal["user", "assistant", "tool"]


class ChatMessage(Stored):
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    # Set on role "tool": which tool produced this result.
    tool_name: str | None = None
    # The query (envelope message id) this message belongs to. A redelivered
    # query finds its own messages by it, so a retried turn is never doubled.
    query_id: str | None = None
    # An answer stopped on request while it was being written: its text is
    # the part written until then.
    stopped: bool = False
    # On a final answer, the provider's counts for the call that wrote it: a
    # page opened later shows them, and a resend of its query hears them.
    # None when the provider gave none, and on answers stored before they were
    # kept. Not checked for sense: a count a model server got wrong must not
    # cost the turn its answer.
    # Written only when set: a version before them refused any message
    # naming them, so a question or a tool result is written as it was then.
    prompt_tokens: int | None = Field(default=None, exclude_if=_unset)
    completion_tokens: int | None = Field(default=None, exclude_if=_unset)


class Snapshot(Stored):
    """The whole history after a compaction: a summary plus the kept messages.

    The summary is None only after a structural fallback (old tool output
    elided, no summary written) on a session that had none before."""

    summary: str | None
    messages: tuple[ChatMessage, ...] = ()
    compactions: int = Field(ge=1)
    # The compaction request (its envelope's message id) this snapshot answers,
    # so a redelivered request finds its work done; None inside a turn.
    request_id: str | None = None
    # The queries whose turns this and earlier compactions folded into the
    # summary, and those whose answers retries replaced, the latest last (a
    # bounded number of them): a query that comes back (its acknowledgement
    # lost, or resent under its key) finds it was answered.
    compacted_query_ids: tuple[str, ...] = ()
    # What the transcript's marker tells a person; None on snapshots written
    # before markers carried them.
    at: Timestamp | None = None
    auto: bool | None = None
    level: str | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None


class HistoryEntry(Stored):
    kind: Literal["turn", "snapshot"]
    messages: tuple[ChatMessage, ...] = ()
    snapshot: Snapshot | None = None
    # On a turn: the stream sequence of the snapshot its context starts at
    # (0: none, the context starts at the subject's first entry).
    base: int = Field(default=0, ge=0)
    # A retried answer: the query whose answer (the assistant and tool
    # messages after the last user message) this turn's messages replace in
    # the context. The earlier entry is kept as it was written, so a
    # transcript shows both, the older one superseded by this entry.
    supersedes: str | None = None

    @classmethod
    def of_turn(cls, messages: tuple[ChatMessage, ...], base: int = 0,
                supersedes: str | None = None) -> HistoryEntry:
        return cls(kind="turn", messages=messages, base=base, supersedes=supersedes)

    @classmethod
    def of_message(cls, message: ChatMessage) -> HistoryEntry:
        return cls.of_turn((message,))

    @classmethod
    def of_snapshot(cls, snapshot: Snapshot) -> HistoryEntry:
        return cls(kind="snapshot", snapshot=snapshot)


class Conversation(Stored):
    """A session's history as the model sees it (minus the pinned system prompt)."""

    summary: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    compactions: int = 0
    # The request the last compaction answered, if it answered one.
    compacted_by: str | None = None
    # The queries whose turns are folded into the summary (see `Snapshot`).
    compacted_query_ids: tuple[str, ...] = ()
    # Queries whose answers a retry replaced in the context (a message's, or
    # an earlier retry's): answered, though the context may no longer show it.
    superseded_query_ids: tuple[str, ...] = ()
    # The last entry folded in was a snapshot: no model call has been sent
    # with this summary yet, so a prompt cache can share only the system prompt.
    just_compacted: bool = False

    def reply_to(self, session_id: str, query_id: str) -> Reply | None:
        """The reply for a query whose final answer is stored, while the
        context holds it: what a caller whose reply was lost is sent. For a
        message whose answer a retry has replaced, the answer standing now."""
        answer = self._answer_of(query_id)
        if answer is None:
            return None
        return Reply(session_id=session_id, query_id=query_id,
                     reply=answer.content, stopped=answer.stopped,
                     prompt_tokens=answer.prompt_tokens,
                     completion_tokens=answer.completion_tokens)

    def _answer_of(self, query_id: str) -> ChatMessage | None:
        # A turn is stored whole, so a user message stored under the query
        # means that query was answered: by its own answer, or by a retry's.
        asked_at = None
        for index, message in enumerate(self.messages):
            if message.query_id != query_id:
                continue
            if message.role == "assistant" and not message.tool_calls:
                return message
            if message.role == "user":
                asked_at = index
        return None if asked_at is None else final_answer_after(self.messages, asked_at)

    def answered(self, session_id: str, query_id: str) -> Reply | None:
        """What the history says of a query it has answered: the stored reply,
        or, once a compaction folded that turn into the summary or a later
        retry replaced a retry's answer, an `already_answered` error. None for
        a query not answered yet."""
        reply = self.reply_to(session_id, query_id)
        if reply is not None:
            return reply
        if query_id in self.compacted_query_ids:
            return _already_answered(session_id, query_id, "a compaction has since folded "
                                     "its answer into the summary")
        if query_id in self.superseded_query_ids:
            return _already_answered(session_id, query_id, "a later retry has since "
                                     "replaced its answer")
        return None

    def question(self, query_id: str) -> str | None:
        """The user's message stored under `query_id`, while the context holds it."""
        for message in reversed(self.messages):
            if message.query_id == query_id and message.role == "user":
                return message.content
        return None

    def apply(self, entry: HistoryEntry) -> Conversation:
        if entry.kind == "snapshot" and entry.snapshot is not None:
            snap = entry.snapshot
            return Conversation(
                summary=snap.summary, messages=snap.messages, compactions=snap.compactions,
                compacted_by=snap.request_id, compacted_query_ids=snap.compacted_query_ids,
                just_compacted=True,
            )
        kept, superseded = self.messages, self.superseded_query_ids
        if entry.supersedes is not None:
            kept = without_answer(kept, entry.supersedes)
            superseded = (*superseded, entry.supersedes)[-KEPT_SUPERSEDED:]
        return self.model_copy(update={"messages": (*kept, *entry.messages),
                                       "superseded_query_ids": superseded,
                                       "just_compacted": False})


def _already_answered(session_id: str, query_id: str, since: str) -> Reply:
    return Reply(session_id=session_id, query_id=query_id, error_code="already_answered",
                 error=f"this query was answered before, and {since}")


def final_answer_after(messages: tuple[ChatMessage, ...], asked_at: int) -> ChatMessage | None:
    """The last assistant message without tool calls that answers the user
    message at `asked_at` (before the next user message)."""
    answer = None
    for message in messages[asked_at + 1:]:
        if message.role == "user":
            break
        if message.role == "assistant" and not message.tool_calls:
            answer = message
    return answer


def without_answer(messages: tuple[ChatMessage, ...], query_id: str
                   ) -> tuple[ChatMessage, ...]:
    """The messages with the answer to `query_id` (its assistant and tool
    messages after the last user message) taken off the end."""
    end = len(messages)
    while (end > 0 and messages[end - 1].role != "user"
           and messages[end - 1].query_id == query_id):
        end -= 1
    return messages[:end]


def fold(entries: list[HistoryEntry]) -> Conversation:
    conversation = Conversation()
    for entry in entries:
        conversation = conversation.apply(entry)
    return conversation
