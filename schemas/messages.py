"""Payloads, one model per kind of message.

Each payload names its `MESSAGE_TYPE`; `schemas.registry` maps subjects to
payloads. Every model forbids unknown fields so that a typo in another
implementation fails loudly at the boundary instead of being dropped.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.session import CountBasis
from schemas.subjects import SESSION_ID_PATTERN

SessionId = str
MAX_CONTENT_CHARS = 1_000_000


class Level(StrEnum):
    """How hard a compaction squeezes: the harder, the fewer of the latest
    turns it keeps whole."""

    gentle = "gentle"
    tighter = "tighter"
    emergency = "emergency"


class Payload(BaseModel):
    # No infinity or NaN: a rate of inf in a report made the decider's sums fail.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    MESSAGE_TYPE: ClassVar[str]


class Query(Payload):
    """A user's message for a session, submitted by the gateway."""

    MESSAGE_TYPE = "chat.query"
    session_id: SessionId = Field(pattern=SESSION_ID_PATTERN)
    content: str = Field(min_length=1, max_length=MAX_CONTENT_CHARS)
    # Ask the generator to publish tokens as they come (costs one message each).
    stream: bool = False
    # A fresh answer to the session's last user message (`content` repeats it):
    # the new answer takes the old one's place in the context.
    retry: bool = False
    # For a retry: the answer it was asked to replace, by its query id ("" when
    # the message had none yet). One written since (a retry from another tab)
    # makes it `retry_outdated` rather than replace that one too. None: not checked.
    replacing: str | None = Field(default=None, max_length=128)


class ErrorCode(StrEnum):
    """The `error_code` values a reply may carry (the gateway maps each to an
    HTTP status). Other implementations may send codes of their own."""

    unknown_session = "unknown_session"
    context_overflow = "context_overflow"
    compacting = "compacting"
    unreachable = "unreachable"
    provider_error = "provider_error"
    empty_reply = "empty_reply"
    timeout = "timeout"
    tool_loop_limit = "tool_loop_limit"
    internal_error = "internal_error"
    # The model is not on the model server; the message says how to pull it.
    model_not_found = "model_not_found"
    # A retry with no user message to answer again, or one that another
    # message overtook.
    nothing_to_retry = "nothing_to_retry"
    retry_outdated = "retry_outdated"
    # Answered before: by a compaction or a retry since, or by an error the
    # query failed with on an earlier try (the gateway's records).
    already_answered = "already_answered"
    failed_before = "failed_before"
    # NATS refused to keep the answer (its store is full), or did not answer.
    storage_full = "storage_full"
    nats_unavailable = "nats_unavailable"
    # A query that does not match its schema (the message names the fields).
    invalid_message = "invalid_message"
    # Stopped while it still waited for its turn: never sent to the model,
    # and nothing of it is stored.
    withdrawn = "withdrawn"


class Reply(Payload):
    """The outcome of one query: the answer, or an error naming its cause
    (`error_code`, one of `ErrorCode` here). `query_id` is the query
    envelope's `message_id`: a waiter matches its reply by it."""

    MESSAGE_TYPE = "chat.reply"
    session_id: SessionId
    query_id: str
    reply: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None
    # What a thinking model thought before answering: shown apart, never
    # stored as context.
    thinking: str | None = None
    # The answer was stopped on request: `reply` is the part written until then.
    stopped: bool = False


class StopRequest(Payload):
    """Stop the session's answer being written (core NATS request on
    `chat.stop.<session>`); only the process running that answer replies.
    A named query that no process runs yet is withdrawn by whichever comes
    to run it: answered `withdrawn`, never sent to the model."""

    MESSAGE_TYPE = "chat.stop"
    session_id: SessionId = Field(pattern=SESSION_ID_PATTERN)
    # Only the answer to this query, when given: a caller whose own message
    # still waits in the queue must not stop another caller's answer.
    query_id: str | None = Field(default=None, min_length=1, max_length=128)


class StopAccepted(Payload):
    """The reply to a `StopRequest` from the process that runs or holds the query."""

    MESSAGE_TYPE = "chat.stop.accepted"
    session_id: SessionId
    query_id: str
    generator_id: str
    # `stopping`: the answer being written ends now. `withdrawing`: the query
    # waits for its turn in this process, and will be answered `withdrawn`.
    # `finishing`: its answer is written and being stored; nothing is stopped.
    status: Literal["stopping", "withdrawing", "finishing"] = "stopping"


class Token(Payload):
    """A piece of an answer being streamed."""

    MESSAGE_TYPE = "chat.token"
    session_id: SessionId
    query_id: str
    index: int = Field(ge=0)
    text: str


class GenerationReport(Payload):
    """One finished generation, with the provider's own counts (`response.generation`)."""

    MESSAGE_TYPE = "response.generation"
    session_id: SessionId = Field(pattern=SESSION_ID_PATTERN)
    model: str
    # The provider's count; None when it gave none (Ollama omits it on cache hits).
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    sent_chars: int = Field(ge=0)
    # Messages in the prompt: the provider charges framing per message.
    sent_messages: int = Field(default=0, ge=0)
    # UTF-8 bytes beyond one per character: dense scripts cost more tokens.
    sent_extra_bytes: int = Field(default=0, ge=0)
    num_ctx: int = Field(gt=0)
    duration_ms: float = Field(default=0.0, ge=0)
    # What the next call would send without a new user message, in characters,
    # and how many of those lie before the live zone (what compaction could free).
    next_prompt_chars: int | None = Field(default=None, ge=0)
    next_prompt_messages: int = Field(default=0, ge=0)
    next_prompt_extra_bytes: int = Field(default=0, ge=0)
    compactable_chars: int | None = Field(default=None, ge=0)
    # The same for the smaller live zones of the tighter and emergency levels.
    compactable_chars_by_level: dict[Level, int] = Field(default_factory=dict)
    # Of those, the existing summary: a compaction rewrites it rather than frees it.
    summary_chars: int = Field(default=0, ge=0)
    # The session's tokens-per-character ratio after this call (None: not yet
    # calibrated), so the decider counts the context as the rest of the system does.
    tokens_per_char: float | None = Field(default=None, gt=0)
    # And per UTF-8 byte beyond a character's first, once learnt (None: the
    # cautious rate for dense scripts).
    tokens_per_extra_byte: float | None = Field(default=None, ge=0)
    # The whole count those rates were last taken from: until dense text has a
    # rate of its own, it bounds what dense text can cost (the gauge's count).
    count_basis: CountBasis | None = None
    # The part of this prompt the provider may have served from its cache
    # (its longest common prefix, in messages, with the session's previous
    # call): a count covering only the rest must not be taken for the whole.
    reused_chars: int = Field(default=0, ge=0)
    reused_extra_bytes: int = Field(default=0, ge=0)
    reused_messages: int = Field(default=0, ge=0)
    auto_compact: bool = True
    # How many compactions the measured history had been through: a report
    # measured before a compaction's splice, read after its result, is out of
    # date (None: not said; such a report is judged as it comes).
    compactions: int | None = Field(default=None, ge=0)


class CompactionRequest(Payload):
    MESSAGE_TYPE = "compaction.request"
    session_id: SessionId = Field(pattern=SESSION_ID_PATTERN)
    auto: bool
    reason: str = Field(default="", max_length=2000)
    level: Level = Level.gentle
    instructions: str | None = Field(default=None, max_length=4000)


CompactionStatus = Literal["completed", "skipped", "failed"]


class CompactionResult(Payload):
    """The one terminal event of a compaction attempt."""

    MESSAGE_TYPE = "compaction.result"
    session_id: SessionId
    tokens_before: int | None = None
    tokens_after: int | None = None
    summary: str | None = None
    error: str | None = None
    status: CompactionStatus = "completed"
    auto: bool = False
    level: Level = Level.gentle
    # "elision": no summary could be written, old tool output was cut instead.
    method: Literal["summary", "elision"] | None = None
    note: str | None = None
    # On a completed one: how many compactions the history has been through,
    # this one included (reports with fewer were measured before it).
    compactions: int | None = Field(default=None, ge=0)


class CompactionEvent(Payload):
    """A compaction's announcement (`started`), then, while a summary is
    written in pieces, one `progress` per piece written."""

    MESSAGE_TYPE = "compaction.event"
    session_id: SessionId
    event: Literal["started", "progress"]
    level: Level
    auto: bool
    reason: str = ""
    tokens_before: int | None = None
    # On `progress`: how many of the summary's pieces are written, of how many.
    pieces_done: int | None = Field(default=None, ge=0)
    pieces_total: int | None = Field(default=None, ge=1)


class StateChange(Payload):
    MESSAGE_TYPE = "generator.state"
    session_id: SessionId
    from_state: str
    to_state: str
    action: str
    generator_id: str


class SessionDeleted(Payload):
    """A session is gone: its record, transcript, summary and queued messages."""

    MESSAGE_TYPE = "session.deleted"
    session_id: SessionId


class ToolInvocation(Payload):
    MESSAGE_TYPE = "tool.call"
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolOutcome(Payload):
    MESSAGE_TYPE = "tool.result"
    name: str
    content: str | None = None
    error: str | None = None


class ToolListRequest(Payload):
    """Ask for the tools on offer (a NATS request on `tool.list`)."""

    MESSAGE_TYPE = "tool.list"


class ToolDefinitions(Payload):
    """The reply to a `ToolListRequest`: the tools on offer, each an Ollama tool
    definition as the model is sent it."""

    MESSAGE_TYPE = "tool.list.result"
    tools: list[dict[str, Any]] = Field(default_factory=list)


class ErrorReport(Payload):
    """A structured error: the answer to a bad request, or a note on a bad event."""

    MESSAGE_TYPE = "error"
    code: str
    message: str
    subject: str | None = None
    details: list[dict[str, Any]] = Field(default_factory=list)
