"""The model behind one small protocol, and its Ollama implementation.

The generator only knows `ChatProvider`; anything that can answer a list of
chat messages (with tools) and report token counts can stand in for Ollama.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import ollama
import structlog
from httpx_aiohttp import AiohttpTransport
from pydantic import ValidationError

from schemas.history import ToolCall
from schemas.messages import ErrorCode
from services.generator.model_traffic import ModelTraffic, Started
from services.generator.models import (
    ASSUMED,
    ModelBook,
    ModelFacts,
    ThinkMode,
    TimeLimits,
    facts_from_show,
    think_field,
)

log = structlog.get_logger()
OnToken = Callable[[str], Awaitable[None]]
# Idle connections to the model are closed after this, before servers
# commonly close them (uvicorn after 5 s).
IDLE_CONNECTION_S = 2.0


class ModelTimeout(Exception):
    """One of the two time limits ran out; the text says which."""


class ProviderError(Exception):
    """The model could not answer; `cause` is a short machine-readable tag."""

    def __init__(self, cause: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.cause = cause


# What Ollama says, with 400, of a prompt longer than the window it was sent
# with `"truncate": false` (0.12.6: the first; later releases: the others).
WINDOW_EXCEEDED = ("exceeds the context length", "exceed_context_size_error",
                   "exceeds the available context size")


def model_not_found(model: str) -> ProviderError:
    return ProviderError(ErrorCode.model_not_found, f'the model "{model}" is not there: Ollama has '
                         f"not pulled it. Pull it with `ollama pull {model}`, or pick "
                         "another model")


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    # The window asked for; the model's own, if smaller, is sent instead.
    num_ctx: int
    # Offered only to a model that has the `tools` capability.
    tools: Sequence[dict[str, Any]] = ()
    # The most tokens the answer may have (Ollama's num_predict); None: no limit.
    num_predict: int | None = None
    # For thinking models: "auto" leaves the model's default (it thinks),
    # "on"/"off" say so. Other models are sent no `think` at all.
    think: ThinkMode = "auto"
    # Stream even if nobody watches the tokens, so that a model that stalls
    # midway is caught by the gap limit (long calls such as summaries).
    watch_gaps: bool = False
    # Background work (a summary): sent only when the model's answers leave
    # it room (see model_traffic).
    background: bool = False


@dataclass(frozen=True)
class ChatResult:
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    thinking: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # "length" when the answer was cut off at num_predict (or the window).
    done_reason: str | None = None
    # Stopped on request: `content` is what was written until then.
    stopped: bool = False


class ChatProvider(Protocol):
    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult: ...

    async def facts(self, model: str) -> ModelFacts: ...

    async def close(self) -> None: ...


class OllamaProvider:
    """Ollama over HTTP. What each model can do is read from `/api/show` once
    per model and kept (`facts`); a call that fails in a way saying the model
    changed (not there, tools or thinking refused) corrects what is kept."""

    def __init__(self, host: str, timeout_s: float, connections: int = 64,
                 gap_s: float | None = None) -> None:
        self._host = host
        self._limits = TimeLimits(timeout_s, timeout_s if gap_s is None else gap_s)
        # aiohttp under the ollama client's httpx: with one kept-alive
        # connection per session answered at once, httpx's own pool scans
        # every idle connection on every request; aiohttp's does not.
        limits = httpx.Limits(max_connections=connections,
                              max_keepalive_connections=connections,
                              keepalive_expiry=IDLE_CONNECTION_S)
        # No timeout of the client's own: ours (first token, gap) are tighter.
        self._client = ollama.AsyncClient(host=host, timeout=None,
                                          transport=AiohttpTransport(limits=limits))
        # Absolute, and built once: given a path, httpx merges it into the
        # base URL anew on every request, about a tenth of the client's
        # CPU per call. (The merge appends to the base's path, as here.)
        base = self._client._client.base_url
        self._chat_url = base.copy_with(raw_path=base.raw_path + b"api/chat")
        self._models = ModelBook(self._show)
        self._traffic = ModelTraffic()

    def traffic(self) -> dict[str, dict[str, int]]:
        return self._traffic.state()

    async def facts(self, model: str) -> ModelFacts:
        return await self._models.facts(model)

    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult:
        facts = await self.facts(request.model)
        try:
            return await self._mapped(request, facts, on_token)
        except ollama.ResponseError as err:
            corrected = self._models.learn(request.model, facts, err)
            if corrected is None:
                raise self._refused(request.model, err) from err
            try:
                return await self._mapped(request, corrected, on_token)
            except ollama.ResponseError as again:
                raise self._refused(request.model, again) from again

    async def close(self) -> None:
        await self._client.close()  # type: ignore[no-untyped-call]

    async def _mapped(self, request: ChatRequest, facts: ModelFacts,
                      on_token: OnToken | None) -> ChatResult:
        """One answer, every failure but Ollama's own refusals made a ProviderError."""
        body = self._body(request, facts)
        turn = self._traffic.summary if request.background else self._traffic.answer
        try:
            async with turn(request.model) as started:
                return await self._answer(body, request.watch_gaps, on_token, started)
        except ModelTimeout as err:
            raise ProviderError(ErrorCode.timeout, str(err)) from err
        except (httpx.TransportError, ConnectionError) as err:
            raise self._unreachable(err) from err
        except ValidationError as err:  # e.g. a tool call without a usable name
            problem = err.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(part) for part in problem["loc"]) or "(answer)"
            raise ProviderError(ErrorCode.provider_error, "the model's answer could not be "
                                f"read: {where}: {problem['msg']}") from err

    def _unreachable(self, err: Exception) -> ProviderError:
        return ProviderError(ErrorCode.unreachable, f"Ollama at {self._host} is unreachable: {err}")

    def _refused(self, model: str, err: ollama.ResponseError) -> ProviderError:
        if err.status_code == 404:
            return model_not_found(model)
        if err.status_code == -1:  # an error line in a stream under way, after a 200
            return ProviderError(ErrorCode.provider_error,
                                 f"Ollama failed during the answer: {err.error}")
        if err.status_code == 400 and any(words in err.error for words in WINDOW_EXCEEDED):
            return ProviderError(ErrorCode.context_overflow, "the model counted more tokens "
                                 f"than its window holds: {err.error}")
        return ProviderError(ErrorCode.provider_error,
                             f"Ollama answered HTTP {err.status_code}: {err.error}")

    def _body(self, request: ChatRequest, facts: ModelFacts) -> dict[str, Any]:
        num_ctx = self._models.window(request.model, request.num_ctx, facts)
        options: dict[str, Any] = {"num_ctx": num_ctx}
        if request.num_predict is not None:
            options["num_predict"] = request.num_predict
        # Refused whole rather than cut to fit: Ollama's silent cut drops old
        # messages (the system prompt too, on some releases) and tells nobody.
        # Releases before 0.12.6 ignore the field, and still cut.
        body: dict[str, Any] = {"model": request.model, "messages": request.messages,
                                "options": options, "truncate": False}
        if request.tools and facts.tools:
            body["tools"] = list(request.tools)
        think = think_field(request.think, facts)
        if think is not None:
            body["think"] = think
        return body

    async def _show(self, model: str) -> ModelFacts:
        """What `/api/show` says of the model; asked again once when the
        connection fails before an answer (see `_answer`)."""
        for attempt in (1, 2):
            try:
                async with asyncio.timeout(self._limits.first_token_s):
                    return facts_from_show(await self._client.show(model))
            except TimeoutError as err:
                raise ProviderError(ErrorCode.timeout, f"Ollama did not describe {model} within "
                                    f"{self._limits.first_token_s:g} s") from err
            except ollama.ResponseError as err:
                if err.status_code == 404:
                    raise model_not_found(model) from err
                if err.status_code >= 500:  # passing, probably: asked again next call
                    raise self._refused(model, err) from err
                # A server that cannot describe models: assume what Ollama always did.
                log.warning("model_not_described", model=model, error=err.error)
                return ASSUMED
            except (httpx.TransportError, ConnectionError) as err:
                if attempt == 2:
                    raise self._unreachable(err) from err
        raise AssertionError("unreachable")

    async def _answer(self, body: dict[str, Any], watch_gaps: bool,
                      on_token: OnToken | None, started: Started) -> ChatResult:
        """One answer; asked again once when the connection fails before any of
        it arrived: a kept-alive connection the server closed as we picked it
        up fails that way, and a fresh one does not."""
        forwarded = False

        async def forward(text: str) -> None:
            nonlocal forwarded
            forwarded = True
            assert on_token is not None
            await on_token(text)

        try:
            return await self._once(body, watch_gaps, forward if on_token else None, started)
        except (httpx.TransportError, ConnectionError):
            if forwarded:
                raise
            return await self._once(body, watch_gaps, on_token, started)

    async def _once(self, body: dict[str, Any], watch_gaps: bool,
                    on_token: OnToken | None, started: Started) -> ChatResult:
        if on_token is None and not watch_gaps:
            # Nobody watches the tokens: one response costs far less CPU than
            # parsing a chunk per word. Its first token is the whole answer.
            try:
                async with asyncio.timeout(self._limits.first_token_s):
                    return await self._whole(body)
            except TimeoutError as err:
                raise ModelTimeout(self._limits.first_token_message()) from err
        return await self._stream(body, on_token, started)

    async def _whole(self, body: dict[str, Any]) -> ChatResult:
        response = await self._send(body, stream=False)
        message = response.message
        return ChatResult(
            content=message.content or "",
            tool_calls=_tool_calls(message),
            thinking=message.thinking or "",
            prompt_tokens=response.prompt_eval_count,
            completion_tokens=response.eval_count,
            done_reason=response.done_reason,
        )

    async def _stream(self, body: dict[str, Any], on_token: OnToken | None,
                      first_part: Started) -> ChatResult:
        """The answer part by part: the first must come within the first-token
        limit, each next one within the gap limit of the one before."""
        content: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        final: ollama.ChatResponse | None = None
        started = False
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._limits.first_token_s) as deadline:
                async for part in await self._send(body, stream=True):
                    if not started:
                        started = True
                        first_part()
                    deadline.reschedule(loop.time() + self._limits.gap_s)
                    message = part.message
                    if message.content:
                        content.append(message.content)
                        if on_token is not None:
                            await on_token(message.content)
                    if message.thinking:
                        thinking.append(message.thinking)
                    calls.extend(_tool_calls(message))
                    if part.done:
                        final = part  # the last part carries the counts
        except TimeoutError as err:
            raise ModelTimeout(self._limits.gap_message() if started
                               else self._limits.first_token_message()) from err
        return ChatResult(
            content="".join(content),
            tool_calls=tuple(calls),
            thinking="".join(thinking),
            prompt_tokens=final.prompt_eval_count if final else None,
            completion_tokens=final.eval_count if final else None,
            done_reason=final.done_reason if final else None,
        )

    async def _send(self, body: dict[str, Any], stream: bool) -> Any:
        """The chat call with the body built here. `AsyncClient.chat` would first
        validate every message of the prompt into a pydantic model and dump it
        back to the same JSON: the largest share of the generator's CPU per
        answer, growing with the history. The client's request method keeps its
        transport, error mapping and response parsing."""
        send: Any = self._client._request
        return await send(ollama.ChatResponse, "POST", self._chat_url,
                          json={**body, "stream": stream}, stream=stream)


def _tool_calls(message: ollama.Message) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(name=call.function.name, arguments=dict(call.function.arguments or {}))
                 for call in message.tool_calls or ())
