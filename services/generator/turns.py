"""One turn of one session: from a query to its stored, published answer.

Called with the session's lock held. The turn reads the history, sends the
pinned system prompt + summary + messages to the model, runs the tool loop,
appends the turn's messages with compare-and-swap, and publishes the
`response.generation` report. It never appends anything partial: all the
turn's messages are written at the end in one history entry, tagged with the
query's id, so a redelivered query finds its answer and is never answered
twice.

Before every model call the prompt is measured against the budget. Over it,
the turn compacts first (emergency level) when automatic compaction is on,
and refuses with a clear error when it is off or cannot make room: nothing
that would overflow the window is ever sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from schemas import subjects
from schemas.envelope import Envelope
from schemas.history import ChatMessage, Conversation
from schemas.messages import GenerationReport, Query, Reply
from schemas.session import SessionRecord
from services.core.boundary import choose_boundary, tail_turns_for
from services.core.decision import Level, check_fit
from services.core.prompt import HistoryWeights, render_messages, tools_chars
from services.core.prompt_cache import cached_size, previous_call
from services.core.state_machine import Action
from services.core.text_size import Size, prompt_size
from services.core.tokens import Calibration, calibrate, estimate_prompt, prompt_budget
from services.generator.compaction import CompactionFailed, CompactionSkipped, Compactor
from services.generator.head_start import HeadStart, HeadStartCount, still_good
from services.generator.provider import ChatProvider, ChatRequest, ChatResult, ProviderError
from services.generator.session_lock import Lease
from services.generator.settings import GeneratorSettings
from services.generator.states import SessionStates
from services.generator.token_stream import TokenStream
from services.generator.toolbox import Toolbox
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore, HistoryView
from services.shared.live_config import LiveSettings
from services.shared.sessions import SessionStore

log = structlog.get_logger()
Messages = list[dict[str, Any]]
FollowUp = Callable[[], Coroutine[Any, Any, None]]


class TurnError(Exception):
    """The query cannot be answered; `code` and the message go to the caller."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Turn:
    """What one query has produced so far."""

    env: Envelope[Query]
    record: SessionRecord
    view: HistoryView
    # The user's message, then tool calls and results as they come.
    messages: list[ChatMessage]
    # The session's call before the next one (read off the history, then the
    # turn's own previous round), and how much of the last call a prompt cache
    # may have served from it. Held for the turn only.
    previous: Messages | None = None
    reused: Size = field(default_factory=Size)

    @property
    def sid(self) -> str:
        return self.env.payload.session_id

    @property
    def query_id(self) -> str:
        return self.env.message_id


def previous_answer(conversation: Conversation, query_id: str) -> str | None:
    """The final answer already stored for this query, if an earlier delivery got that far."""
    for message in reversed(conversation.messages):
        if message.query_id == query_id and message.role == "assistant" and not message.tool_calls:
            return message.content
    return None


class TurnRunner:
    def __init__(self, bus: Bus, live: LiveSettings[GeneratorSettings], provider: ChatProvider,
                 history: HistoryStore, sessions: SessionStore, states: SessionStates,
                 toolbox: Toolbox, compactor: Compactor) -> None:
        self._bus = bus
        self._live = live
        self._provider = provider
        self._history = history
        self._sessions = sessions
        self._states = states
        self._toolbox = toolbox
        self._compactor = compactor
        self.head_starts = HeadStartCount()

    @property
    def _settings(self) -> GeneratorSettings:
        # Read on every use: `compaction_threshold` may change while we run.
        return self._live.current

    def budget(self) -> int:
        return prompt_budget(self._settings.num_ctx, self._settings.output_headroom)

    async def head_start(self, env: Envelope[Query]) -> HeadStart | None:
        """Send the first model call before the lock is ours, when this process
        knows the session's history and record and the prompt fits."""
        sid = env.payload.session_id
        view, record = self._history.cached(sid), self._sessions.cached(sid)
        if view is None or record is None:
            return None
        tools = await self._toolbox.definitions()
        prompt = render_messages(record.system, view.conversation, [_question(env)])
        if not self._fits(record, prompt, tools):
            return None  # the turn must compact first
        stream = TokenStream(self._bus, env, held=True) if env.payload.stream else None
        call = asyncio.create_task(self._call_model(env, record, prompt, tools, stream))
        return HeadStart(view, record, prompt, tools, stream, call, self.head_starts)

    async def run(self, env: Envelope[Query], record: SessionRecord, lease: Lease,
                  head: HeadStart | None = None) -> tuple[Reply, FollowUp | None]:
        """Answer the query and store the turn. Returns the reply and the
        bookkeeping (calibration, `response.generation`) that neither the caller
        nor the session's next query need wait for."""
        sid, query_id = env.payload.session_id, env.message_id
        view = await self._history.read(sid, current=lease.resumed)
        done = previous_answer(view.conversation, query_id)
        if done is not None:
            log.info("query_already_answered")
            return Reply(session_id=sid, query_id=query_id, reply=done), None
        turn = Turn(env, record, view, [_question(env)],
                    previous=previous_call(record.system, view.conversation))
        started = time.monotonic()
        await self._states.apply(sid, Action.start_generation, env.correlation_id)
        result, prompt, tools = await self._tool_loop(turn, self._kept(head, turn))
        answer = ChatMessage(role="assistant", content=result.content, query_id=query_id)
        await self._states.apply(sid, Action.publish, env.correlation_id)
        turn.view = await self._history.append(sid, turn.view, [*turn.messages, answer])
        reply = Reply(session_id=sid, query_id=query_id, reply=result.content,
                      prompt_tokens=result.prompt_tokens,
                      completion_tokens=result.completion_tokens)

        async def follow_up() -> None:
            sent = prompt_size(prompt, tools)
            await self._recalibrate(turn, result, sent)
            await self._report(turn, result, sent, tools, started)

        return reply, follow_up

    def _kept(self, head: HeadStart | None, turn: Turn) -> HeadStart | None:
        """The head start if its prompt is the one this turn sends; else cancelled."""
        if head is None:
            return None
        if still_good(head.view, head.record, turn.view, turn.record,
                      lambda: self._fits(turn.record, head.prompt, head.tools)):
            return head
        head.abandon()
        return None

    async def _tool_loop(self, turn: Turn, head: HeadStart | None
                         ) -> tuple[ChatResult, Messages, Messages]:
        tools = head.tools if head else await self._toolbox.definitions()
        for _ in range(self._settings.max_tool_iterations + 1):
            prompt = head.prompt if head else await self._fitting_prompt(turn, tools)
            turn.reused = cached_size(turn.previous or [], prompt, tools)
            turn.previous = prompt
            if head is not None:
                result, head = await head.result(), None  # only the first call starts early
            else:
                result = await self._call_model(turn.env, turn.record, prompt, tools)
            if not result.tool_calls:
                return result, prompt, tools
            call = ChatMessage(role="assistant", content=result.content,
                               tool_calls=result.tool_calls, query_id=turn.query_id)
            turn.messages = [*turn.messages, call, *await self._run_tools(turn.env, result)]
        raise TurnError(
            "tool_loop_limit",
            f"the model kept calling tools after {self._settings.max_tool_iterations} rounds",
        )

    async def _fitting_prompt(self, turn: Turn, tools: Messages) -> Messages:
        prompt = render_messages(turn.record.system, turn.view.conversation, turn.messages)
        if self._fits(turn.record, prompt, tools):
            return prompt
        if not self._may_compact(turn.record):
            raise self._overflow(turn.record, prompt, tools,
                                 "automatic compaction is off for this session: compact it "
                                 "(POST /api/sessions/{id}/compact) or shorten the message")
        try:
            turn.view = await self._compactor.compact_within_turn(turn.record, turn.view,
                                                                  turn.env.correlation_id)
        except (CompactionSkipped, CompactionFailed) as err:
            raise self._overflow(turn.record, prompt, tools,
                                 f"emergency compaction could not make room: {err}") from err
        prompt = render_messages(turn.record.system, turn.view.conversation, turn.messages)
        if not self._fits(turn.record, prompt, tools):
            raise self._overflow(turn.record, prompt, tools,
                                 "it does not fit even after compaction (a single message "
                                 "larger than the window?)")
        return prompt

    def _may_compact(self, record: SessionRecord) -> bool:
        return self._settings.compaction_threshold > 0 and record.auto_compact

    def _estimate(self, record: SessionRecord, prompt: Messages, tools: Messages) -> int:
        return estimate_prompt(prompt, _calibration(record), tools)

    def _fits(self, record: SessionRecord, prompt: Messages, tools: Messages) -> bool:
        return check_fit(self._estimate(record, prompt, tools), self.budget()).fits

    def _overflow(self, record: SessionRecord, prompt: Messages, tools: Messages,
                  advice: str) -> TurnError:
        return TurnError(
            "context_overflow",
            f"the prompt would need about {self._estimate(record, prompt, tools)} tokens but "
            f"the budget is {self.budget()} (num_ctx {self._settings.num_ctx}); {advice}",
        )

    async def _run_tools(self, env: Envelope[Query], result: ChatResult) -> list[ChatMessage]:
        sid = env.payload.session_id
        await self._states.apply(sid, Action.dispatch_tool, env.correlation_id)
        await self._states.apply(sid, Action.await_result, env.correlation_id)
        runs = [await self._toolbox.run(call, env.message_id, env.correlation_id)
                for call in result.tool_calls]
        timed_out = any(run.timed_out for run in runs)
        await self._states.apply(sid, Action.tool_timeout if timed_out else Action.tool_result,
                                 env.correlation_id)
        return [run.message for run in runs]

    async def _call_model(self, env: Envelope[Query], record: SessionRecord, prompt: Messages,
                          tools: Messages, stream: TokenStream | None = None
                          ) -> ChatResult:
        request = ChatRequest(model=record.model_or(self._settings.model), messages=prompt,
                              num_ctx=self._settings.num_ctx, tools=tools)
        if stream is None and env.payload.stream:
            stream = TokenStream(self._bus, env)
        try:
            result = await self._provider.chat(request, stream.send if stream else None)
        except ProviderError as err:
            raise TurnError(err.cause, str(err)) from err
        if not result.content.strip() and not result.tool_calls:
            where = " (its output was all in 'thinking')" if result.thinking else ""
            raise TurnError("empty_reply", f"the model returned an empty reply{where}")
        return result

    async def _recalibrate(self, turn: Turn, result: ChatResult, sent: Size) -> None:
        record, reused = turn.record, turn.reused
        previous = _calibration(record)
        updated = calibrate(previous, result.prompt_tokens, sent.chars, self._settings.num_ctx,
                            messages=sent.messages, extra_bytes=sent.extra_bytes,
                            reused_chars=reused.chars, reused_extra_bytes=reused.extra_bytes,
                            reused_messages=reused.messages)
        if _moved(previous.tokens_per_char, updated.tokens_per_char):
            await self._sessions.put(record.model_copy(
                update={"tokens_per_char": updated.tokens_per_char}))

    async def _report(self, turn: Turn, result: ChatResult, sent: Size,
                      tools: Messages, started: float) -> None:
        conversation = turn.view.conversation
        weights = HistoryWeights.of(turn.record.system, conversation)
        upcoming = prompt_size(render_messages(turn.record.system, conversation), tools)
        compactable = {level.value: weights.compactable(self._boundary(conversation, level))
                       for level in Level}
        report = GenerationReport(
            session_id=turn.sid,
            model=turn.record.model_or(self._settings.model),
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            sent_chars=sent.chars,
            sent_messages=sent.messages,
            sent_extra_bytes=sent.extra_bytes,
            num_ctx=self._settings.num_ctx,
            duration_ms=(time.monotonic() - started) * 1000,
            next_prompt_chars=weights.next_prompt + tools_chars(tools),
            next_prompt_messages=weights.next_prompt_messages,
            next_prompt_extra_bytes=upcoming.extra_bytes,
            compactable_chars=compactable[Level.gentle.value],
            compactable_chars_by_level=compactable,
            reused_chars=turn.reused.chars,
            reused_extra_bytes=turn.reused.extra_bytes,
            reused_messages=turn.reused.messages,
            auto_compact=turn.record.auto_compact,
        )
        await self._bus.js_publish(subjects.RESPONSE_GENERATION, report,
                                   correlation_id=turn.env.correlation_id, session_id=turn.sid,
                                   message_id=f"{turn.query_id}:generation")

    def _boundary(self, conversation: Conversation, level: Level) -> int:
        tail = tail_turns_for(level, self._settings.compaction_tail_turns)
        return choose_boundary(conversation.messages, tail)


def _calibration(record: SessionRecord) -> Calibration:
    return Calibration(record.tokens_per_char)


def _moved(before: float | None, after: float | None) -> bool:
    """Whether the ratio changed enough to be worth a write (0.5 %)."""
    if after is None:
        return False
    return before is None or abs(after / before - 1) > 0.005


def _question(env: Envelope[Query]) -> ChatMessage:
    return ChatMessage(role="user", content=env.payload.content, query_id=env.message_id)
