"""One turn of a session while it runs: what its query has produced so far
(the messages, the model calls and their sizes), and the error that ends a
turn unanswered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.envelope import Envelope
from schemas.history import ChatMessage, Conversation
from schemas.messages import ErrorCode, Query
from schemas.session import SessionRecord
from services.core.prompt_cache import cached_size, previous_call
from services.core.text_size import Size, prompt_size
from services.generator.stops import StopSwitch
from services.shared.history_store import HistoryView

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class WeighedPrompt:
    """A model call's prompt with its size, tools included. Weighed once,
    when it is fitted: the answer's room and the report read the same size,
    and each weighing is a pass over the whole prompt."""

    messages: Messages
    size: Size

    @classmethod
    def of(cls, messages: Messages, tools: Messages) -> WeighedPrompt:
        return cls(messages, prompt_size(messages, tools))


class TurnError(Exception):
    """The query cannot be answered; `code` and the message go to the caller."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class WindowExceeded(TurnError):
    """The model server refused a prompt as longer than its window."""


@dataclass
class Turn:
    """What one query has produced so far."""

    env: Envelope[Query]
    record: SessionRecord
    view: HistoryView
    # The user's message, then tool calls and results as they come.
    messages: list[ChatMessage]
    # The turn's last model call, and the one before it (None for the first:
    # the session's previous call is then read off the history the turn
    # started on). Only the report and the calibration need the part a
    # prompt cache may have served, so it is weighed after the reply
    # (`weigh_cached_part`), not while the model answers.
    last_call: WeighedPrompt = field(default_factory=lambda: WeighedPrompt([], Size()))
    prompt_before: Messages | None = None
    # How much of the last call a prompt cache may have served.
    reused: Size = field(default_factory=Size)
    # The history the turn began on (`view` moves on as the turn is stored).
    started_on: Conversation = field(init=False)
    # A retry's: the history up to the last user message, the answer after
    # it left out (see `services.core.retry`). None for a new message.
    retry_context: Conversation | None = None
    # Thrown by a stop; a head start's own when the turn keeps its call.
    switch: StopSwitch = field(init=False)

    def __post_init__(self) -> None:
        self.started_on = self.view.conversation
        self.switch = StopSwitch(self.env.message_id)

    def called(self, prompt: WeighedPrompt) -> None:
        """A model call is sent with this prompt."""
        self.prompt_before = self.last_call.messages or None
        self.last_call = prompt

    def weigh_cached_part(self, tools: Messages) -> None:
        previous = self.prompt_before
        if previous is None:
            previous = previous_call(self.record.system, self.started_on,
                                     self.record.tokens_per_char is not None)
        self.reused = cached_size(previous, self.last_call.messages, tools, whole=self.sent)

    @property
    def sent(self) -> Size:
        """The last call's size, tools included."""
        return self.last_call.size

    @property
    def context(self) -> Conversation:
        """The history the turn's prompt is built on."""
        return self.retry_context if self.retry_context is not None else self.view.conversation

    @property
    def sid(self) -> str:
        return self.env.payload.session_id

    @property
    def query_id(self) -> str:
        return self.env.message_id
