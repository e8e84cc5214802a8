"""Ollama's answer shapes: the whole JSON answer, the NDJSON stream of word-sized
pieces with the per-token latency spread over them, and the final timing fields."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from starlette.responses import JSONResponse

from .common import JSONObject, sleep_ns
from .quirks import ERROR_TEXT
from .replies import Reply

if TYPE_CHECKING:  # a type only: the state module imports this one, indirectly
    from .state import StubState


# One streamed piece per word; whitespace stays attached so the pieces join losslessly.
_STREAM_PIECE = re.compile(r"\S+\s*|\s+")


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def error_response(status: int, text: str) -> JSONResponse:
    return JSONResponse({"error": text}, status_code=status)


def chat_chunk(model: str, message: JSONObject, done: bool) -> JSONObject:
    return {"model": model, "created_at": now_rfc3339(), "message": message, "done": done}


def reply_message(reply: Reply) -> JSONObject:
    message: JSONObject = {"role": "assistant", "content": reply.content}
    if reply.thinking:
        message["thinking"] = reply.thinking
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message


def stream_messages(reply: Reply) -> list[JSONObject]:
    """The partial messages of a streamed reply: thinking words, content words, tool calls."""
    pieces: list[JSONObject] = [
        {"role": "assistant", "content": "", "thinking": word}
        for word in _STREAM_PIECE.findall(reply.thinking)
    ]
    pieces += [
        {"role": "assistant", "content": word} for word in _STREAM_PIECE.findall(reply.content)
    ]
    if reply.tool_calls:
        pieces.append({"role": "assistant", "content": "", "tool_calls": reply.tool_calls})
    return pieces


@dataclass
class Generation:
    """Everything needed to answer one chat request, computed before any waiting."""

    model: str
    reply: Reply
    prompt_eval_count: int | None
    eval_count: int
    latency_s: float
    per_token_s: float
    started_ns: int
    done_reason: str = "stop"
    # Time this request waited for its model to load (``--load-ms``).
    loading_ns: int = 0
    # The ``error-midway`` quirk: the stream fails after its first piece.
    fails_midway: bool = False
    # The ``no-done`` quirk: the answer ends without its done chunk.
    cut_short: bool = False

    def final_fields(self, load_ns: int, eval_ns: int) -> JSONObject:
        fields: JSONObject = {
            "done_reason": self.done_reason,
            "total_duration": time.perf_counter_ns() - self.started_ns,
            "load_duration": load_ns + self.loading_ns,
        }
        # Omitted, not zero, on a full prompt-cache hit: that is what Ollama does.
        if self.prompt_eval_count is not None:
            fields["prompt_eval_count"] = self.prompt_eval_count
            fields["prompt_eval_duration"] = max(1, self.prompt_eval_count) * 1000
        fields["eval_count"] = self.eval_count
        fields["eval_duration"] = max(1, eval_ns)
        return fields


async def stream_chat(generation: Generation, state: StubState,
                      paused: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """NDJSON chunks; the per-token latency is spread evenly over the pieces,
    and `paused` is waited on after the first. A client that goes away ends the
    generation, as with Ollama."""
    finished = False
    try:
        async for chunk in _chunks(generation, paused):
            yield chunk
        finished = True
    finally:
        if not finished:
            state.streams_cut += 1


async def _chunks(generation: Generation, paused: Callable[[], Awaitable[None]]
                  ) -> AsyncIterator[bytes]:
    load_ns = await sleep_ns(generation.latency_s)
    pieces = stream_messages(generation.reply)
    total_s = generation.per_token_s * generation.eval_count
    eval_started = time.perf_counter_ns()
    if not pieces:
        await sleep_ns(total_s)
    for index, message in enumerate(pieces):
        if index == 1:
            await paused()  # a test's "answer being written", for as long as it needs
        await sleep_ns(total_s / len(pieces))
        yield _ndjson(chat_chunk(generation.model, message, done=False))
        if generation.fails_midway:
            yield _ndjson({"error": ERROR_TEXT})
            return
    if generation.cut_short:
        return
    final = chat_chunk(generation.model, {"role": "assistant", "content": ""}, done=True)
    final.update(generation.final_fields(load_ns, time.perf_counter_ns() - eval_started))
    yield _ndjson(final)


def _ndjson(obj: JSONObject) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def complete_chat(generation: Generation) -> JSONObject:
    load_ns = await sleep_ns(generation.latency_s)
    eval_ns = await sleep_ns(generation.per_token_s * generation.eval_count)
    if generation.cut_short:  # the last piece Ollama had: no counts, not done
        return chat_chunk(generation.model, reply_message(generation.reply), done=False)
    answer = chat_chunk(generation.model, reply_message(generation.reply), done=True)
    answer.update(generation.final_fields(load_ns, eval_ns))
    return answer


def load_response(model: str) -> JSONResponse:
    # What Ollama answers to a chat request without messages: it just loads the model.
    answer = chat_chunk(model, {"role": "assistant", "content": ""}, done=True)
    answer["done_reason"] = "load"
    return JSONResponse(answer)


async def ndjson_lines(lines: Sequence[JSONObject]) -> AsyncIterator[bytes]:
    for line in lines:
        await asyncio.sleep(0)
        yield _ndjson(line)
