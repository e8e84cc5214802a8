"""One turn of one session: from a query to its stored, published answer.

Called with the session's lock held. The turn reads the history, sends the
pinned system prompt + summary + messages to the model, runs the tool loop,
appends the new messages with compare-and-swap, and publishes the
`response.generation` report. It never appends anything partial: every
message of the turn is written at the end, tagged with the query's id, so a
redelivered query recognises its own messages and is never answered twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog

from schemas import subjects
from schemas.envelope import Envelope
from schemas.history import ChatMessage, Conversation
from schemas.messages import GenerationReport, Query, Reply, Token
from schemas.session import SessionRecord
from services.core.boundary import choose_boundary
from services.core.decision import check_fit
from services.core.prompt import render_messages, sent_chars
from services.core.state_machine import Action
from services.core.tokens import Calibration, budget, default_headroom, estimate_tokens
from services.generator.provider import ChatProvider, ChatRequest, ChatResult, ProviderError
from services.generator.settings import GeneratorSettings
from services.generator.states import SessionStates
from services.generator.toolbox import Toolbox
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore, HistoryView
from services.shared.sessions import SessionStore

log = structlog.get_logger()


class TurnError(Exception):
    """The query cannot be answered; `code` and the message go to the caller."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Outcome:
    reply: Reply
    view: HistoryView


def previous_answer(conversation: Conversation, query_id: str) -> str | None:
    """The final answer already stored for this query, if a earlier delivery got that far."""
    for message in reversed(conversation.messages):
        if message.query_id != query_id:
            continue
        if message.role == "assistant" and not message.tool_calls:
            return message.content
    return None


def stored_messages(conversation: Conversation, query_id: str) -> list[ChatMessage]:
    return [m for m in conversation.messages if m.query_id == query_id]


class TurnRunner:
    def __init__(
        self,
        bus: Bus,
        settings: GeneratorSettings,
        provider: ChatProvider,
        history: HistoryStore,
        sessions: SessionStore,
        states: SessionStates,
        toolbox: Toolbox,
    ) -> None:
        self._bus = bus
        self._settings = settings
        self._provider = provider
        self._history = history
        self._sessions = sessions
        self._states = states
        self._toolbox = toolbox

    def budget(self) -> int:
        s = self._settings
        headroom = s.output_headroom if s.output_headroom is not None else default_headroom(s.num_ctx)
        return budget(s.num_ctx, headroom)

    async def run(self, env: Envelope[Query], record: SessionRecord) -> Outcome:
        query, sid, query_id = env.payload, env.payload.session_id, env.message_id
        view = await self._history.read(sid)
        done = previous_answer(view.conversation, query_id)
        if done is not None:
            log.info("query_already_answered", query_id=query_id)
            return Outcome(Reply(session_id=sid, query_id=query_id, reply=done), view)
        # A delivery that died after storing the user message continues from it.
        pending = stored_messages(view.conversation, query_id)
        prior = Conversation(
            summary=view.conversation.summary,
            messages=tuple(m for m in view.conversation.messages if m.query_id != query_id),
            compactions=view.conversation.compactions,
        )
        fresh: list[ChatMessage] = [] if pending else [
            ChatMessage(role="user", content=query.content, query_id=query_id)
        ]
        started = time.monotonic()
        result, new, messages, tools = await self._generate(env, record, prior, pending, fresh)
        answer = ChatMessage(role="assistant", content=result.content, query_id=query_id)
        await self._states.apply(sid, Action.publish, env.correlation_id)
        view = await self._history.append(sid, view, [*new, answer], msg_id=query_id)
        await self._report(env, record, result, messages, tools, view, started)
        return Outcome(
            Reply(session_id=sid, query_id=query_id, reply=result.content,
                  prompt_tokens=result.prompt_tokens,
                  completion_tokens=result.completion_tokens),
            view,
        )

    async def _generate(
        self,
        env: Envelope[Query],
        record: SessionRecord,
        prior: Conversation,
        stored: list[ChatMessage],
        fresh: list[ChatMessage],
    ) -> tuple[ChatResult, list[ChatMessage], list[dict[str, Any]], list[dict[str, Any]]]:
        """The tool loop. `stored` are this query's messages already in the history
        (from a delivery that died), `fresh` those not yet written. Returns the
        final result, the messages to append (all but the answer), the last
        prompt sent and the tools offered."""
        sid, query_id = env.payload.session_id, env.message_id
        tools = await self._toolbox.definitions()
        turn, to_append = [*stored, *fresh], list(fresh)
        await self._states.apply(sid, Action.start_generation, env.correlation_id)
        for _ in range(self._settings.max_tool_iterations + 1):
            messages = render_messages(record.system, prior, turn)
            self._check_fits(record, messages, tools)
            result = await self._call_model(env, record, messages, tools)
            if not result.tool_calls:
                return result, to_append, messages, tools
            call_msg = ChatMessage(role="assistant", content=result.content,
                                   tool_calls=result.tool_calls, query_id=query_id)
            results = await self._run_tools(env, result)
            turn = [*turn, call_msg, *results]
            to_append = [*to_append, call_msg, *results]
        raise TurnError(
            "tool_loop_limit",
            f"the model kept calling tools after {self._settings.max_tool_iterations} rounds",
        )

    async def _run_tools(self, env: Envelope[Query], result: ChatResult) -> list[ChatMessage]:
        sid = env.payload.session_id
        await self._states.apply(sid, Action.dispatch_tool, env.correlation_id)
        await self._states.apply(sid, Action.await_result, env.correlation_id)
        results = [
            await self._toolbox.run(call, env.message_id, env.correlation_id)
            for call in result.tool_calls
        ]
        timed_out = any("timed out" in r.content for r in results)
        action = Action.tool_timeout if timed_out else Action.tool_result
        await self._states.apply(sid, action, env.correlation_id)
        return results

    async def _call_model(
        self,
        env: Envelope[Query],
        record: SessionRecord,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> ChatResult:
        request = ChatRequest(
            model=record.model or self._settings.model,
            messages=messages,
            num_ctx=self._settings.num_ctx,
            tools=tools,
        )
        streamer = _TokenStreamer(self._bus, env) if env.payload.stream else None
        try:
            result = await self._provider.chat(request, streamer.send if streamer else None)
        except ProviderError as err:
            raise TurnError(err.cause, str(err)) from err
        if not result.content.strip() and not result.tool_calls:
            where = " (its output was all in 'thinking')" if result.thinking else ""
            raise TurnError("empty_reply", f"the model returned an empty reply{where}")
        return result

    def _check_fits(
        self, record: SessionRecord, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> None:
        estimate = estimate_tokens(sent_chars(messages, tools),
                                   Calibration(record.tokens_per_char))
        fit = check_fit(estimate, self.budget())
        if not fit.fits:
            raise TurnError(
                "context_overflow",
                f"the prompt would need about {estimate} tokens but the budget is "
                f"{self.budget()} (num_ctx {self._settings.num_ctx}); compact the session "
                "or shorten the message",
            )

    async def _report(
        self,
        env: Envelope[Query],
        record: SessionRecord,
        result: ChatResult,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        view: HistoryView,
        started: float,
    ) -> None:
        sid = env.payload.session_id
        next_prompt = render_messages(record.system, view.conversation)
        boundary = choose_boundary(view.conversation.messages, self._settings.compaction_tail_turns)
        compactable = render_messages("", Conversation(
            summary=view.conversation.summary,
            messages=view.conversation.messages[:boundary]))
        report = GenerationReport(
            session_id=sid,
            model=record.model or self._settings.model,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            sent_chars=sent_chars(messages, tools),
            num_ctx=self._settings.num_ctx,
            duration_ms=(time.monotonic() - started) * 1000,
            next_prompt_chars=sent_chars(next_prompt, tools),
            compactable_chars=sent_chars(compactable),
            auto_compact=record.auto_compact,
        )
        await self._bus.js_publish(subjects.RESPONSE_GENERATION, report,
                                   correlation_id=env.correlation_id, session_id=sid,
                                   message_id=f"{env.message_id}:generation")


class _TokenStreamer:
    def __init__(self, bus: Bus, env: Envelope[Query]) -> None:
        self._bus = bus
        self._env = env
        self._index = 0

    async def send(self, text: str) -> None:
        sid = self._env.payload.session_id
        await self._bus.publish(
            subjects.token(sid),
            Token(session_id=sid, query_id=self._env.message_id, index=self._index, text=text),
            correlation_id=self._env.correlation_id, session_id=sid,
        )
        self._index += 1
