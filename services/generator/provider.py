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
from httpx_aiohttp import AiohttpTransport
from pydantic import ValidationError

from schemas.history import ToolCall

OnToken = Callable[[str], Awaitable[None]]
# Idle connections to the model are closed after this, before servers
# commonly close them (uvicorn after 5 s).
IDLE_CONNECTION_S = 2.0


class ProviderError(Exception):
    """The model could not answer; `cause` is a short machine-readable tag."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    num_ctx: int
    tools: Sequence[dict[str, Any]] = ()
    # The most tokens the answer may have (Ollama's num_predict); None: no limit.
    num_predict: int | None = None


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

    async def close(self) -> None: ...


class OllamaProvider:
    def __init__(self, host: str, timeout_s: float, connections: int = 64) -> None:
        self._host = host
        self._timeout_s = timeout_s
        # aiohttp under the ollama client's httpx: with one kept-alive
        # connection per session answered at once, httpx's own pool scans
        # every idle connection on every request; aiohttp's does not.
        limits = httpx.Limits(max_connections=connections,
                              max_keepalive_connections=connections,
                              keepalive_expiry=IDLE_CONNECTION_S)
        self._client = ollama.AsyncClient(host=host, timeout=timeout_s,
                                          transport=AiohttpTransport(limits=limits))
        # Absolute, and built once: given a path, httpx merges it into the
        # base URL anew on every request, about a tenth of the client's
        # CPU per call. (The merge appends to the base's path, as here.)
        base = self._client._client.base_url
        self._chat_url = base.copy_with(raw_path=base.raw_path + b"api/chat")

    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._answer(request, on_token)
        except TimeoutError as err:
            raise ProviderError(
                "timeout", f"the model did not answer within {self._timeout_s:g} s"
            ) from err
        except ollama.ResponseError as err:
            raise ProviderError(
                "provider_error", f"Ollama answered HTTP {err.status_code}: {err.error}"
            ) from err
        except (httpx.TransportError, ConnectionError) as err:
            raise ProviderError(
                "unreachable", f"Ollama at {self._host} is unreachable: {err}"
            ) from err
        except ValidationError as err:  # e.g. a tool call without a usable name
            problem = err.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(part) for part in problem["loc"]) or "(answer)"
            raise ProviderError(
                "provider_error", f"the model's answer could not be read: {where}: "
                f"{problem['msg']}"
            ) from err

    async def close(self) -> None:
        await self._client.close()  # type: ignore[no-untyped-call]

    async def _answer(self, request: ChatRequest, on_token: OnToken | None) -> ChatResult:
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
            return await self._once(request, forward if on_token else None)
        except (httpx.TransportError, ConnectionError):
            if forwarded:
                raise
            return await self._once(request, on_token)

    async def _once(self, request: ChatRequest, on_token: OnToken | None) -> ChatResult:
        if on_token is None:
            # Nobody watches the tokens: one response costs far less CPU than
            # parsing a chunk per word.
            return await self._whole(request)
        return await self._stream(request, on_token)

    async def _whole(self, request: ChatRequest) -> ChatResult:
        response = await self._send(request, stream=False)
        message = response.message
        return ChatResult(
            content=message.content or "",
            tool_calls=_tool_calls(message),
            thinking=message.thinking or "",
            prompt_tokens=response.prompt_eval_count,
            completion_tokens=response.eval_count,
            done_reason=response.done_reason,
        )

    async def _stream(self, request: ChatRequest, on_token: OnToken) -> ChatResult:
        content: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []
        final: ollama.ChatResponse | None = None
        async for part in await self._send(request, stream=True):
            message = part.message
            if message.content:
                content.append(message.content)
                await on_token(message.content)
            if message.thinking:
                thinking.append(message.thinking)
            calls.extend(_tool_calls(message))
            if part.done:
                final = part  # the last part carries the counts
        return ChatResult(
            content="".join(content),
            tool_calls=tuple(calls),
            thinking="".join(thinking),
            prompt_tokens=final.prompt_eval_count if final else None,
            completion_tokens=final.eval_count if final else None,
            done_reason=final.done_reason if final else None,
        )

    async def _send(self, request: ChatRequest, stream: bool) -> Any:
        """The chat call with the body built here. `AsyncClient.chat` would first
        validate every message of the prompt into a pydantic model and dump it
        back to the same JSON: the largest share of the generator's CPU per
        answer, growing with the history. The client's request method keeps its
        transport, error mapping and response parsing."""
        options: dict[str, Any] = {"num_ctx": request.num_ctx}
        if request.num_predict is not None:
            options["num_predict"] = request.num_predict
        body: dict[str, Any] = {"model": request.model, "messages": request.messages,
                                "stream": stream, "options": options}
        if request.tools:
            body["tools"] = list(request.tools)
        send: Any = self._client._request
        return await send(ollama.ChatResponse, "POST", self._chat_url, json=body, stream=stream)


def _tool_calls(message: ollama.Message) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(name=call.function.name, arguments=dict(call.function.arguments or {}))
                 for call in message.tool_calls or ())
