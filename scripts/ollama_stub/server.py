"""The HTTP server: the routes of the Ollama API and of ``/_stub/``, the path of one
chat request through them, and the uvicorn server that releases hanging requests at exit."""

from __future__ import annotations

import asyncio
import socket
import time
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .chat_request import BadRequest, ChatRequest, parse_chat_request
from .common import STUB_MODEL, STUB_VERSION, TOO_LONG_TEXT, ChatMessage, normalize_model
from .directives import StubConfig, apply_config_update, wait_while_held, wait_while_paused
from .models import (
    apply_thinking,
    held_stream,
    model_entry,
    model_refusal,
    pull_progress,
    show_answer,
)
from .quirks import (
    ERROR_TEXT,
    apply_empty_content_quirk,
    reported_prompt_count,
    wait_until_disconnected,
)
from .replies import build_reply, limit_to_num_predict, request_kind
from .responses import (
    Generation,
    complete_chat,
    error_response,
    load_response,
    ndjson_lines,
    stream_chat,
)
from .state import StubState
from .tokens import count_completion_tokens, count_prompt_tokens, truncate_to_fit


def _state(request: Request) -> StubState:
    state: StubState = request.app.state.stub
    return state


async def _read_json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both land here
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


def receive_prompt(state: StubState, request: ChatRequest
                   ) -> tuple[list[ChatMessage], int] | None:
    """Record the prompt as received, then truncate it as Ollama would; None
    when it is too long and the request asked not to be truncated.

    Recording comes first so the stats show the untruncated size, under every quirk.
    """
    config = state.config
    asked = request.options.get("num_ctx") or config.default_num_ctx
    # Ollama runs a model with at most the window it was trained for, whatever was asked.
    num_ctx = min(asked, config.models.context_length_of(request.model))
    received = count_prompt_tokens(request.messages, request.tools, config.chars_per_token)
    too_long = received > num_ctx
    state.record_prompt(request.model, received, truncated=too_long and request.truncate,
                        refused=too_long and not request.truncate)
    if too_long and not request.truncate:
        return None
    return truncate_to_fit(request.messages, request.tools, num_ctx, config.chars_per_token)


def prepare_generation(
    state: StubState,
    request: ChatRequest,
    kept: list[ChatMessage],
    prompt_tokens: int,
    started_ns: int,
) -> Generation:
    config = state.config
    reply = build_reply(request, kept)
    apply_thinking(config.models, request, reply, kept)
    if "empty-content" in config.quirks:
        apply_empty_content_quirk(reply)
    cpt = config.chars_per_token
    done_reason = limit_to_num_predict(reply, request.options.get("num_predict"), cpt)
    return Generation(
        model=request.model,
        reply=reply,
        prompt_eval_count=reported_prompt_count(state, request, kept, prompt_tokens),
        eval_count=count_completion_tokens(reply.content, reply.thinking, reply.tool_calls, cpt),
        latency_s=config.latency_ms(request.model) / 1000,
        per_token_s=config.ms_per_token / 1000,
        started_ns=started_ns,
        done_reason=done_reason,
    )


async def chat_endpoint(request: Request) -> Response:
    started_ns = time.perf_counter_ns()
    state = _state(request)
    # Counted on arrival so that failed, malformed and hanging requests all show up.
    state.totals.requests += 1
    try:
        chat = parse_chat_request(await _read_json(request))
    except BadRequest as exc:
        return error_response(400, str(exc))
    refusal = model_refusal(state.config.models, chat)
    if refusal is not None:
        return refusal
    received = receive_prompt(state, chat)
    if received is None:
        return error_response(400, TOO_LONG_TEXT)
    kept, prompt_tokens = received
    loading_ns = await state.loads.ensure_loaded(chat.model)
    if not chat.messages:
        return load_response(chat.model)
    quirks = state.config.quirks
    if "error" in quirks or ("error-midway" in quirks and not chat.stream):
        return error_response(500, ERROR_TEXT)
    if "hang" in state.config.quirks:
        await wait_until_disconnected(request, state)
        return error_response(503, "stub: hang ended")
    state.slots.note(chat.model, "arrived", request_kind(chat), chat.options.get("num_ctx"))
    await wait_while_held(state, chat.model)
    generation = prepare_generation(state, chat, kept, prompt_tokens, started_ns)
    generation.loading_ns = loading_ns
    generation.fails_midway = "error-midway" in quirks
    generation.cut_short = "no-done" in quirks
    return await answer_in_slot(state, chat, generation)


async def answer_in_slot(state: StubState, chat: ChatRequest, generation: Generation) -> Response:
    """The answer, produced while holding one of the model's parallel slots."""
    slot = await state.slots.take(chat.model, request_kind(chat))
    if chat.stream:
        pieces = stream_chat(generation, state, lambda: wait_while_paused(state, chat.model))
        # The background task frees the slot even if the client left before the stream began.
        return StreamingResponse(held_stream(pieces, slot),
                                 media_type="application/x-ndjson",
                                 background=BackgroundTask(slot.release))
    try:
        whole = await complete_chat(generation)
        slot.first_chunk()  # the whole answer is its first chunk
        return JSONResponse(whole)
    finally:
        slot.release()


async def tags_endpoint(request: Request) -> Response:
    names = listed_models(_state(request))
    return JSONResponse({"models": [model_entry(name) for name in names]})


async def version_endpoint(request: Request) -> Response:
    return JSONResponse({"version": STUB_VERSION})


async def root_endpoint(request: Request) -> Response:
    # Same banner as Ollama, handy for health checks.
    return PlainTextResponse("Ollama is running")


async def requested_model(request: Request) -> tuple[str, dict[str, Any]] | Response:
    """The body of a `/api/show` or `/api/pull` request and the model it names
    (as `model` or, in older clients, `name`), or the 400 Ollama answers
    without one."""
    try:
        body = await _read_json(request)
    except BadRequest as exc:
        return error_response(400, str(exc))
    model = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        return error_response(400, "model is required")
    return model, body


async def show_endpoint(request: Request) -> Response:
    asked = await requested_model(request)
    if isinstance(asked, Response):
        return asked
    model, _ = asked
    config = _state(request).config
    if not config.models.has(model):
        return error_response(404, f"model '{model}' not found")
    return JSONResponse(show_answer(config.models, model, config.default_num_ctx))


async def stats_endpoint(request: Request) -> Response:
    return JSONResponse(_state(request).stats_json())


async def reset_endpoint(request: Request) -> Response:
    state = _state(request)
    state.reset()
    return JSONResponse(state.stats_json())


async def config_endpoint(request: Request) -> Response:
    state = _state(request)
    if request.method == "POST":
        try:
            apply_config_update(state.config, await _read_json(request))
        except BadRequest as exc:
            return error_response(400, str(exc))
        state.announce_config_change()
    return JSONResponse(state.config.as_json())


def build_app(config: StubConfig) -> Starlette:
    """The stand-in as an ASGI app; usable in-process (e.g. httpx.ASGITransport)."""
    app = Starlette(
        routes=[
            Route("/", root_endpoint, methods=["GET", "HEAD"]),
            Route("/api/chat", chat_endpoint, methods=["POST"]),
            Route("/api/tags", tags_endpoint, methods=["GET"]),
            Route("/api/version", version_endpoint, methods=["GET"]),
            Route("/api/show", show_endpoint, methods=["POST"]),
            Route("/api/pull", pull_endpoint, methods=["POST"]),
            Route("/_stub/stats", stats_endpoint, methods=["GET"]),
            Route("/_stub/slots", slots_endpoint, methods=["GET"]),
            Route("/_stub/reset", reset_endpoint, methods=["POST"]),
            Route("/_stub/config", config_endpoint, methods=["GET", "POST"]),
        ]
    )
    app.state.stub = StubState(config=config)
    return app


async def slots_endpoint(request: Request) -> Response:
    return JSONResponse(_state(request).slots.as_json())


async def pull_endpoint(request: Request) -> Response:
    asked = await requested_model(request)
    if isinstance(asked, Response):
        return asked
    model, body = asked
    state = _state(request)
    lines = pull_progress(model)
    state.config.models.pulled(model)
    state.seen_models.setdefault(normalize_model(model), None)
    if body.get("stream") is False:
        return JSONResponse(lines[-1])
    return StreamingResponse(ndjson_lines(lines), media_type="application/x-ndjson")


def listed_models(state: StubState) -> list[str]:
    served = state.config.models.served
    if served is None:
        return list(dict.fromkeys([STUB_MODEL, *state.seen_models]))
    return sorted(served)


class StubServer(uvicorn.Server):
    """uvicorn server that also releases hanging requests when asked to exit.

    Without this a ``hang``-quirk request would hold graceful shutdown until its timeout.
    """

    def __init__(self, config: uvicorn.Config, state: StubState) -> None:
        super().__init__(config)
        self._stub_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        event = self._stub_state.shutdown_event
        try:
            # Signal handlers run between bytecodes; hand the wake-up to the loop safely.
            asyncio.get_running_loop().call_soon_threadsafe(event.set)
        except RuntimeError:
            event.set()
        super().handle_exit(sig, frame)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before announcing, so the printed URL is immediately usable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # An explicit IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets
    # whose proto says TCP, and without it every keep-alive request stalls ~40 ms (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock
