"""One turn of one session: from a query to its stored, published answer.

Called with the session's lock held. The turn reads the history, sends the
pinned system prompt + summary + messages to the model, runs the tool loop,
appends the turn's messages with compare-and-swap, and publishes the
`response.generation` report. It never appends anything partial: all the
turn's messages are written at the end in one history entry, tagged with the
query's id, so a redelivered query finds its answer and is never answered
twice.

Before every model call the prompt is made to fit the budget (`fitting`):
compacted first (emergency level) when automatic compaction is on, refused
with a clear error when it is off or cannot make room. Nothing that would
overflow the window is ever sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import structlog
from nats.js.errors import APIError

from schemas import subjects
from schemas.envelope import Envelope
from schemas.history import ChatMessage, Conversation
from schemas.messages import ErrorCode, GenerationReport, Level, Query, Reply
from schemas.session import SessionRecord
from services.core.boundary import choose_boundary, tail_turns_for
from services.core.decision import answer_room
from services.core.prompt import render_messages
from services.core.retry import RetryRefused, retry_verdict
from services.core.state_machine import Action
from services.core.text_size import HistoryWeights, prompt_size
from services.core.tokens import (
    calibrate,
    prompt_budget,
    refused_as_too_long,
    stored_calibration,
    with_calibration,
    worth_storing,
)
from services.generator.compaction import (
    CompactionStopped,
    Compactor,
)
from services.generator.fitting import Fitting, estimate, size_estimate, size_fits
from services.generator.head_start import HeadStart, HeadStartCount, still_good
from services.generator.models import ModelFacts
from services.generator.provider import (
    ChatProvider,
    ChatRequest,
    ChatResult,
    OnToken,
    ProviderError,
)
from services.generator.session_lock import Lease
from services.generator.settings import GeneratorSettings
from services.generator.states import SessionStates
from services.generator.stops import Stops, StopSwitch, Withdrawn
from services.generator.token_stream import TokenStream
from services.generator.toolbox import Toolbox, ToolRun
from services.generator.turn import Messages, Turn, TurnError, WeighedPrompt, WindowExceeded
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore, HistoryView
from services.shared.jetstream import NO_ROOM, no_room
from services.shared.live_config import LiveSettings
from services.shared.nats_away import NATS_AWAY
from services.shared.query_errors import WITHDRAWN_TEXT
from services.shared.sessions import SessionNotFound, SessionStore

log = structlog.get_logger()
# Streamed between one model call's text and the next's, after tool calls: the
# text written before calling a tool ("Let me check.") and the answer written
# with its result ran together as one sentence. Not part of what is stored.
ROUND_BREAK = "\n\n"
FollowUp = Callable[[], Coroutine[Any, Any, None]]


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
        self.stops = Stops()

    @property
    def _settings(self) -> GeneratorSettings:
        # Read on every use: `compaction_threshold` may change while we run.
        return self._live.current

    def num_ctx(self, record: SessionRecord) -> int:
        """NUM_CTX, or the window of the session's model if that is smaller."""
        return record.window(self._settings.num_ctx)

    def budget(self, record: SessionRecord) -> int:
        return prompt_budget(self.num_ctx(record), self._settings.output_headroom)

    async def _prompt(self, turn: Turn, head: HeadStart | None, tools: Messages
                      ) -> WeighedPrompt:
        """The head start's prompt, which fitted; else the turn's, made to fit."""
        if head is not None:
            return head.prompt
        record = turn.record
        fitting = Fitting(self._settings, self._compactor, self.budget(record),
                          self.num_ctx(record))
        return await fitting.prompt(turn, tools)

    async def _facts(self, record: SessionRecord) -> ModelFacts:
        try:
            return await self._provider.facts(record.model_or(self._settings.model))
        except ProviderError as err:
            raise TurnError(err.cause, str(err)) from err

    async def _with_window(self, record: SessionRecord) -> SessionRecord:
        """The record with its model's window as the model describes it now,
        stored when that changed (the page's gauge reads it)."""
        window = (await self._facts(record)).context_length
        if window == record.context_length:
            return record
        record = record.model_copy(update={"context_length": window})
        await self._sessions.update(record)
        return record

    async def _offered_tools(self, record: SessionRecord) -> Messages:
        """The tools, for a model that can call them; none for the others."""
        if not (await self._facts(record)).tools:
            return []
        return await self._toolbox.definitions()

    async def head_start(self, env: Envelope[Query]) -> HeadStart | None:
        """Send the first model call before the lock is ours, when this process
        knows the session's history and record and the prompt fits."""
        sid = env.payload.session_id
        view, record = self._history.cached(sid), self._sessions.cached(sid)
        if view is None or record is None or env.payload.retry:
            return None
        try:
            tools = await self._offered_tools(record)
        except TurnError:
            return None  # the turn itself will meet the error and report it
        prompt = WeighedPrompt.of(
            render_messages(record.system, view.conversation, [_question(env)]), tools)
        if not size_fits(record, prompt.size, self.budget(record)):
            return None  # the turn must compact first
        stream = TokenStream(self._bus, env, held=True) if env.payload.stream else None
        switch = StopSwitch(env.message_id)
        call = asyncio.create_task(self._call_model(env, record, prompt, tools, stream, switch))
        return HeadStart(view, record, prompt, tools, stream, call, self.head_starts, switch)

    async def run(self, env: Envelope[Query], record: SessionRecord, lease: Lease,
                  head: HeadStart | None = None) -> tuple[Reply, FollowUp | None]:
        """Answer the query and store the turn. Returns the reply and the
        bookkeeping (calibration, `response.generation`) that neither the caller
        nor the session's next query need wait for."""
        sid, query_id = env.payload.session_id, env.message_id
        view = await self._history_under(sid, lease)
        answered = _answered_before(view, sid, query_id)
        if answered is not None:
            lease.leaves_history_at = view.last_seq
            return answered, None
        record = await self._with_window(record)
        turn, supersedes = self._new_turn(env, record, view)
        started = time.monotonic()
        result, tools = await self._stoppable(turn, self._kept(head, turn))
        answer = ChatMessage(role="assistant", content=result.content, query_id=query_id,
                             stopped=result.stopped, prompt_tokens=result.prompt_tokens,
                             completion_tokens=result.completion_tokens)
        await self._states.apply(sid, Action.publish, env.correlation_id)
        await self._store(turn, answer, supersedes)
        lease.leaves_history_at = turn.view.last_seq
        if result.stopped:
            log.info("answer_stopped", chars=len(result.content))
        reply = Reply(session_id=sid, query_id=query_id, reply=result.content,
                      prompt_tokens=result.prompt_tokens,
                      completion_tokens=result.completion_tokens,
                      thinking=result.thinking or None, stopped=result.stopped)

        async def follow_up() -> None:
            turn.weigh_cached_part(tools)
            await self._recalibrate(turn, result)
            await self._report(turn, result, tools, started)

        return reply, follow_up

    async def _stoppable(self, turn: Turn, kept: HeadStart | None
                         ) -> tuple[ChatResult, Messages]:
        """The turn's model calls, stoppable from their start; a query stopped
        before it is withdrawn instead."""
        if kept is not None:
            turn.switch = kept.switch
        try:
            with self.stops.running(turn.sid, turn.switch):
                await self._states.apply(turn.sid, Action.start_generation,
                                         turn.env.correlation_id)
                return await self._tool_loop(turn, kept)
        except Withdrawn as err:
            raise TurnError(ErrorCode.withdrawn, WITHDRAWN_TEXT) from err

    async def _store(self, turn: Turn, answer: ChatMessage, supersedes: str | None) -> None:
        """Append the turn. A server without room, or NATS not answering for
        all the store's patience, is the caller's to hear of, not a crash to
        try again: each try would ask the model anew."""
        first = turn.view.last_seq == 0
        try:
            turn.view = await self._history.append(turn.sid, turn.view,
                                                   [*turn.messages, answer], supersedes)
        except NATS_AWAY as err:
            raise TurnError(ErrorCode.nats_unavailable, "NATS did not take the answer for too long "
                            f"({type(err).__name__}); try again in a moment") from err
        except APIError as err:
            if not no_room(err):
                raise
            raise TurnError(ErrorCode.storage_full, f"the answer was not kept: {NO_ROOM}") from err
        if first and not await self._sessions.exists(turn.sid):
            # Deleted while its first answer was written: the delete removes
            # the record before the history, so this read sees it gone
            # whenever the purge may have come before the append.
            await self._history.discard(turn.sid)
            raise SessionNotFound(turn.sid)

    async def _history_under(self, sid: str, lease: Lease) -> HistoryView:
        """The session's history, read with its lock held."""
        view = await self._history.read(sid, current=lease.resumed, at=lease.found_history_at)
        if view.last_seq == 0 and not await self._sessions.exists(sid):
            # Asked afresh only for an empty history: a session deleted while
            # this process kept its record must not be written again.
            raise SessionNotFound(sid)
        return view

    @staticmethod
    def _new_turn(env: Envelope[Query], record: SessionRecord, view: HistoryView
                  ) -> tuple[Turn, str | None]:
        """The turn, and for a retry the query whose answer its answer replaces."""
        if not env.payload.retry:
            return Turn(env, record, view, [_question(env)]), None
        point = retry_verdict(view.conversation, env.payload.content, env.payload.replacing)
        if isinstance(point, RetryRefused):
            raise TurnError(point.code, point.message)
        return (Turn(env, record, view, [], retry_context=point.context),
                point.supersedes)

    def _kept(self, head: HeadStart | None, turn: Turn) -> HeadStart | None:
        """The head start if its prompt is the one this turn sends; else cancelled."""
        if head is None:
            return None
        if still_good(head.view, head.record, turn.view, turn.record,
                      lambda: size_fits(turn.record, head.prompt.size, self.budget(turn.record))):
            return head
        head.abandon()
        return None

    async def _tool_loop(self, turn: Turn, head: HeadStart | None
                         ) -> tuple[ChatResult, Messages]:
        """The last call's result, and the tools it was offered."""
        tools = head.tools if head else await self._offered_tools(turn.record)
        stream = self._turn_stream(turn.env, head)
        refused, rounds = False, 0
        while True:
            try:
                prompt = await self._prompt(turn, head, tools)
            except CompactionStopped:
                return ChatResult(content="", stopped=True), tools
            turn.called(prompt)
            try:
                result = await (head.result() if head else self._call_model(
                    turn.env, turn.record, prompt, tools, stream, turn.switch))
            except WindowExceeded:
                if refused:
                    raise
                refused = True
                await self._learn_from_refusal(turn, prompt.messages, tools)
                continue  # fitted again: compacted, or refused as too long
            finally:
                head = None  # only the first call starts early
            if not result.tool_calls or result.stopped:
                return result, tools
            if rounds == self._settings.max_tool_iterations:  # none run past the limit
                raise TurnError(ErrorCode.tool_loop_limit, f"the model kept calling tools after "
                                f"{rounds} rounds")
            ran = await self._run_tools(turn, result)
            if ran is None:  # stopped: the text so far is the answer
                return replace(result, tool_calls=(), stopped=True), tools
            call = ChatMessage(role="assistant", content=result.content,
                               tool_calls=result.tool_calls, query_id=turn.query_id)
            turn.messages, rounds = [*turn.messages, call, *ran], rounds + 1
            if stream is not None and result.content:  # the next call's text, apart from this
                await stream.send(ROUND_BREAK)

    def _turn_stream(self, env: Envelope[Query], head: HeadStart | None) -> TokenStream | None:
        """One numbering for all the model calls of a turn: a call after a tool
        result that began again at 0 would look like a redelivered query, and
        the caller would wipe the text the first call streamed."""
        if not env.payload.stream:
            return None
        if head is not None and head.stream is not None:
            return head.stream
        return TokenStream(self._bus, env)

    async def _run_tools(self, turn: Turn, result: ChatResult) -> list[ChatMessage] | None:
        """The results of the calls `result` asks for; None when the answer is
        stopped before they all came (the calls are cut short, as a timeout
        cuts them)."""
        env, sid = turn.env, turn.sid
        await self._states.apply(sid, Action.dispatch_tool, env.correlation_id)
        await self._states.apply(sid, Action.await_result, env.correlation_id)
        runs = await turn.switch.unless_thrown(self._runs(env, result))
        if runs is None:
            await self._states.apply(sid, Action.stop, env.correlation_id)
            return None
        timed_out = any(run.timed_out for run in runs)
        await self._states.apply(sid, Action.tool_timeout if timed_out else Action.tool_result,
                                 env.correlation_id)
        return [run.message for run in runs]

    async def _runs(self, env: Envelope[Query], result: ChatResult) -> list[ToolRun]:
        return [await self._toolbox.run(call, env.message_id, env.correlation_id,
                                        env.payload.session_id)
                for call in result.tool_calls]

    async def _call_model(self, env: Envelope[Query], record: SessionRecord,
                          prompt: WeighedPrompt, tools: Messages,
                          stream: TokenStream | None = None,
                          switch: StopSwitch | None = None) -> ChatResult:
        num_ctx = self.num_ctx(record)
        # The answer may take what the prompt leaves of the window, no more:
        # unbounded, Ollama lets a looping model write ten windows' worth,
        # dropping the prompt's start (the system prompt) to make room. (Its
        # turn may then fill the budget: the next one compacts it too.)
        room = answer_room(num_ctx, self.budget(record), size_estimate(record, prompt.size))
        request = ChatRequest(model=record.model_or(self._settings.model), messages=prompt.messages,
                              num_ctx=num_ctx, tools=tools, think=self._settings.think,
                              num_predict=room)
        if stream is None and env.payload.stream:
            stream = TokenStream(self._bus, env)
        switch = switch or StopSwitch(env.message_id)
        switch.written = []
        # A stopped answer keeps what its caller was shown: the streamed text.
        # Unstreamed, the answer comes whole (far cheaper than a chunk per
        # word), so one stopped before its end keeps nothing.
        on_token = _heard_by(switch, stream) if stream is not None else None
        try:
            result = await switch.unless_thrown(self._provider.chat(request, on_token))
        except ProviderError as err:
            if err.cause == ErrorCode.context_overflow:
                raise WindowExceeded(err.cause, str(err)) from err
            raise TurnError(err.cause, str(err)) from err
        if result is None:
            return ChatResult(content="".join(switch.written), stopped=True)
        if result.done_reason == "length":
            log.warning("answer_cut_at_its_room", num_predict=room)
        if not result.content.strip() and not result.tool_calls:
            where = " (its output was all in 'thinking')" if result.thinking else ""
            raise TurnError(ErrorCode.empty_reply, f"the model returned an empty reply{where}")
        return result

    async def _learn_from_refusal(self, turn: Turn, prompt: Messages, tools: Messages) -> None:
        """The model server refused as longer than the window a prompt the
        estimate said would fit: the window is a count the prompt exceeds,
        so the session's rates rise to it (never fall) and are stored before
        the prompt is fitted again."""
        num_ctx = self.num_ctx(turn.record)
        previous = stored_calibration(turn.record)
        raised = refused_as_too_long(previous, prompt_size(prompt, tools), num_ctx)
        log.warning("prompt_refused_as_too_long", num_ctx=num_ctx,
                    estimate=estimate(turn.record, prompt, tools))
        if raised != previous:
            turn.record = with_calibration(turn.record, raised)
            await self._sessions.update(turn.record)

    async def _recalibrate(self, turn: Turn, result: ChatResult) -> None:
        record, sent, reused = turn.record, turn.sent, turn.reused
        previous = stored_calibration(record)
        updated = calibrate(previous, result.prompt_tokens, sent.chars, self.num_ctx(record),
                            messages=sent.messages, extra_bytes=sent.extra_bytes,
                            reused_chars=reused.chars, reused_extra_bytes=reused.extra_bytes,
                            reused_messages=reused.messages)
        if worth_storing(previous, updated):
            turn.record = with_calibration(record, updated)
            await self._sessions.update(turn.record)

    async def _report(self, turn: Turn, result: ChatResult, tools: Messages,
                      started: float) -> None:
        conversation, sent = turn.view.conversation, turn.sent
        weights = HistoryWeights.of(turn.record.system, conversation)
        compactable = {level: weights.compactable(self._boundary(conversation, level))
                       for level in Level}
        upcoming = weights.next_prompt_size(tools)
        report = GenerationReport(
            session_id=turn.sid,
            model=turn.record.model_or(self._settings.model),
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            sent_chars=sent.chars,
            sent_messages=sent.messages,
            sent_extra_bytes=sent.extra_bytes,
            num_ctx=self.num_ctx(turn.record),
            duration_ms=(time.monotonic() - started) * 1000,
            next_prompt_chars=upcoming.chars,
            next_prompt_messages=upcoming.messages,
            next_prompt_extra_bytes=upcoming.extra_bytes,
            compactable_chars=compactable[Level.gentle],
            compactable_chars_by_level=compactable,
            summary_chars=weights.summary,
            # As stored in the session's record: the ratio the gateway counts with.
            tokens_per_char=turn.record.tokens_per_char,
            tokens_per_extra_byte=turn.record.tokens_per_extra_byte,
            count_basis=turn.record.count_basis,
            reused_chars=turn.reused.chars,
            reused_extra_bytes=turn.reused.extra_bytes,
            reused_messages=turn.reused.messages,
            auto_compact=turn.record.auto_compact,
            compactions=conversation.compactions,
        )
        # Not awaited for the stream's acknowledgement: a report lost on the
        # way costs the decider one reading, and the next report carries all
        # it needs (`Decider._consider`).
        await self._bus.publish(subjects.RESPONSE_GENERATION, report,
                                correlation_id=turn.env.correlation_id, session_id=turn.sid,
                                message_id=f"{turn.query_id}:generation")

    def _boundary(self, conversation: Conversation, level: Level) -> int:
        tail = tail_turns_for(level, self._settings.compaction_tail_turns)
        return choose_boundary(conversation.messages, tail)


def _heard_by(switch: StopSwitch, stream: TokenStream) -> OnToken:
    async def on_token(text: str) -> None:
        await switch.heard(text)
        await stream.send(text)
    return on_token


def _question(env: Envelope[Query]) -> ChatMessage:
    return ChatMessage(role="user", content=env.payload.content, query_id=env.message_id)


def _answered_before(view: HistoryView, sid: str, query_id: str) -> Reply | None:
    """The reply for a query the history shows answered already (a
    redelivery whose acknowledgement was lost), or None for a new one."""
    done = view.conversation.answered(sid, query_id)
    if done is not None:
        if done.error_code == "already_answered":
            log.warning("query_answered_earlier_out_of_context", error=done.error)
        else:
            log.info("query_already_answered")
    return done
