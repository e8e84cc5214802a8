"""The Ollama behaviours switched on with ``--quirk`` (or live, by ``/_stub/config``).

- ``cache-count``: prompt_eval_count counts only what follows the prompt-cache prefix,
  and is left out when that is tiny (Ollama before 0.1.49; later releases count the
  whole prompt, as the stand-in does without the quirk).
- ``empty-content``: the answer comes in the thinking channel only.
- ``error``: a 500.
- ``error-midway``: a streamed answer's first piece, then an ``{"error": ...}`` line
  and no done chunk, as Ollama ends a stream that fails once it has begun (a request
  not streamed gets the 500).
- ``no-done``: the answer ends without its done chunk (no counts, no done_reason), as
  Ollama ends one whose model repeats a token over and over (a request not streamed
  gets its last piece, ``done`` false).
- ``hang``: no answer until the client goes away or the stand-in exits.

How models differ (404, no tools, thinking, windows, loads, parallel slots) lives in
``models``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from .chat_request import ChatRequest
from .common import ChatMessage, canonical_json, first_of, normalize_model
from .replies import Reply
from .tokens import count_message_tokens

if TYPE_CHECKING:  # a type only: the state module imports this one, indirectly
    from .state import StubState


QUIRKS = ("cache-count", "empty-content", "error", "error-midway", "hang", "no-done")
ERROR_TEXT = "stub: simulated internal error"
# Below this many new tokens a prompt-cache hit makes Ollama omit prompt_eval_count.
CACHE_MIN_TOKENS = 5


def apply_empty_content_quirk(reply: Reply) -> None:
    """Some models answer only in the thinking channel; callers must cope with it."""
    if reply.content:
        reply.thinking = f"{reply.thinking}\n{reply.content}" if reply.thinking else reply.content
        reply.content = ""


def _fingerprint(tools: Sequence[Any], messages: Sequence[ChatMessage]) -> tuple[str, list[str]]:
    keys = ("role", "content", "thinking", "tool_calls", "tool_name", "images")
    normalized = [canonical_json({k: m.get(k) or None for k in keys}) for m in messages]
    return canonical_json(list(tools)), normalized


def reported_prompt_count(
    state: StubState, request: ChatRequest, kept: Sequence[ChatMessage], prompt_tokens: int
) -> int | None:
    """The prompt_eval_count to report, remembering this prompt for the next request.

    With the ``cache-count`` quirk Ollama only counts tokens it had to evaluate: it keeps
    the previous request's prompt (per model, whatever session sent it) and reuses its
    longest common prefix, in whole messages here, so a prompt costs only what follows
    that prefix (the tools are cached with it), and the field is left out entirely when
    that rest is tiny.
    """
    key = normalize_model(request.model)
    if "cache-count" not in state.config.quirks:
        # No cache to emulate: skip the fingerprint, the larger part of this
        # stand-in's CPU per request under load; the first prompt after the
        # quirk is switched on is counted in full, like a cold cache.
        state.prompt_cache.pop(key, None)
        return prompt_tokens
    current = _fingerprint(request.tools, kept)
    previous = state.prompt_cache.get(key)
    state.prompt_cache[key] = current
    if previous is None:
        return prompt_tokens
    shared = 0
    if previous[0] == current[0]:
        for before, now in zip(previous[1], current[1], strict=False):
            if before != now:
                break
            shared += 1
    if shared == 0:
        return prompt_tokens
    cpt = state.config.chars_per_token
    suffix_tokens = sum(count_message_tokens(m, cpt) for m in kept[shared:])
    return None if suffix_tokens < CACHE_MIN_TOKENS else suffix_tokens


async def _next_disconnect(request: Request) -> None:
    # The body has been read, so the server's next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_until_disconnected(request: Request, state: StubState) -> None:
    """Simulate a wedged model: never answer, but let the client or a shutdown end it."""
    await first_of(_next_disconnect(request), state.shutdown_event.wait())
