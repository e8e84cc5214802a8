"""Ollama-compatible stand-in HTTP server for tests and benchmarks.

It speaks enough of the Ollama REST API (``/api/chat``, ``/api/tags``, ``/api/show``,
``/api/version``, ``/api/pull``) for the real ``ollama.AsyncClient`` to talk to it, and answers
deterministically from the input so tests can assert on exact replies and token counts.
It also reproduces the Ollama behaviours the chat backend has to survive: silent
context truncation, prompt-cache token counts, thinking-only replies, 500s and hangs,
and the way models differ: some are not pulled (404), some lack tools (400), thinking
models think unless told not to, each has its own window, a first call loads the model,
and a model serves only so many requests at once (``--models``, ``--capabilities``,
``--context-length``, ``--load-ms``, ``--parallel``).

Run it with ``python -m scripts.ollama_stub --port 11435`` (see ``--help``).
Control endpoints under ``/_stub/`` expose statistics and change behaviour live.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import re
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

JSONObject = dict[str, Any]
ChatMessage = dict[str, Any]

QUIRKS = ("cache-count", "empty-content", "error", "hang")
ROLES = ("system", "user", "assistant", "tool")
STUB_MODEL = "stub-model:latest"
STUB_VERSION = "0.0.0-stub"
SUMMARY_MARKER = "COMPACTION SUMMARY"
ERROR_TEXT = "stub: simulated internal error"
# Events kept by `/_stub/slots` (arrivals, slots taken, first chunks, ends).
SLOT_LOG_LENGTH = 10_000

# Every chat message costs a few template tokens on top of its text, like real chat templates.
PER_MESSAGE_OVERHEAD = 4
# A CJK character costs 0.6-0.8 tokens on Llama 3 and Qwen tokenizers.
DENSE_TOKENS_PER_CHAR = 0.7
# Below this many new tokens a prompt-cache hit makes Ollama omit prompt_eval_count.
CACHE_MIN_TOKENS = 5
SUMMARY_MIN_CHARS = 80
SUMMARY_MAX_CHARS = 4000
GOAL_MAX_CHARS = 200
ECHO_MAX_CHARS = 120
# Keeps a mistyped "!long" from exhausting memory.
LONG_MAX_CHARS = 2_000_000
FIXED_TIMESTAMP = "2024-01-01T00:00:00Z"

FILLER_WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
    "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore",
    "magna", "aliqua", "enim", "ad", "minim", "veniam", "quis", "nostrud",
)  # fmt: skip

_TOOL_DIRECTIVE = re.compile(r"!tool\s+([A-Za-z_][\w.\-]*)")
_LONG_DIRECTIVE = re.compile(r"!long\s+(\d+)")
# `!lead "Let me check"`: the text a tool-calling reply writes before its calls.
_LEAD_DIRECTIVE = re.compile(r'!lead\s+"([^"]*)"')
# In a transcript being summarised: write a summary of that many characters
# (to exceed num_predict and see the answer cut off with done_reason "length").
_SUMMARY_DIRECTIVE = re.compile(r"!summary\s+(\d+)")
# Keep calling the tool after each result, for tests of a runaway tool loop.
_TOOL_LOOP_DIRECTIVE = "!toolloop"
_FIRST_REQUEST = re.compile(r"FIRST REQUEST[^\n]*\n(.+)")
_EARLIER_GOAL = re.compile(r"EARLIER NOTES[^\n]*\n(?:.*\n)*?Goal: (.+)")
# The user label of a transcript rendered into one message: "[user]", "user:", "**User**:",
# with the text on the same line or on the lines below it.
_TRANSCRIPT_USER_LABEL = re.compile(r"^[ \t#*>]*(?:\[user\]:?|user\**:)[ \t]*(.*)$", re.IGNORECASE)
_NOT_DENSE = re.compile("[\x00-\u07ff]+")
_NOT_TWO_BYTE = re.compile("[^\u0080-\u07ff]+")
# One streamed piece per word; whitespace stays attached so the pieces join losslessly.
_STREAM_PIECE = re.compile(r"\S+\s*|\s+")


# --------------------------------------------------------------------------- configuration


@dataclass
class StubConfig:
    """Behaviour of the stand-in; mutable so ``/_stub/config`` can change it live."""

    host: str = "127.0.0.1"
    port: int = 11435
    chars_per_token: float = 4.0
    ms_per_token: float = 0.0
    model_latency: dict[str, float] = field(default_factory=dict)
    quirks: set[str] = field(default_factory=set)
    default_num_ctx: int = 2048
    # Requests for these models wait until they are let go (a config change):
    # a call that is under way for exactly as long as a test needs it to be.
    held_models: set[str] = field(default_factory=set)

    def holds(self, model: str) -> bool:
        return normalize_model(model) in {normalize_model(name) for name in self.held_models}

    # Set at start-up only (command-line flags), so not part of ``as_json``.
    models: ModelCatalogue = field(default_factory=lambda: ModelCatalogue())

    def latency_ms(self, model: str) -> float:
        """Fixed per-request latency; ``name`` and ``name:latest`` are the same model."""
        wanted = normalize_model(model)
        for name, millis in self.model_latency.items():
            if normalize_model(name) == wanted:
                return millis
        return 0.0

    def as_json(self) -> JSONObject:
        return {
            "quirks": sorted(self.quirks),
            "ms_per_token": self.ms_per_token,
            "model_latency": dict(self.model_latency),
            "chars_per_token": self.chars_per_token,
            "default_num_ctx": self.default_num_ctx,
            "held_models": sorted(self.held_models),
        }


def normalize_model(name: str) -> str:
    """Ollama treats an untagged model name as ``:latest``."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


# --------------------------------------------------------------------------- tokenizer


def canonical_json(value: Any) -> str:
    """Compact, key-sorted JSON, so equal structures always cost the same tokens."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message contributes to the prompt: content, tool calls, thinking."""
    text = str(message.get("content") or "")
    tool_calls = message.get("tool_calls")
    if tool_calls:
        text += canonical_json(tool_calls)
    return text + str(message.get("thinking") or "")


def count_text_tokens(text: str, chars_per_token: float) -> int:
    """``chars_per_token`` ASCII characters make a token; other scripts are
    denser, as on real tokenizers: a character of two UTF-8 bytes (Greek,
    Cyrillic, Arabic) costs twice an ASCII one, and one of three or four
    (CJK, kana, Hangul) DENSE_TOKENS_PER_CHAR."""
    if text.isascii():
        return math.ceil(len(text) / chars_per_token)
    dense = len(_NOT_DENSE.sub("", text))
    two_byte = len(_NOT_TWO_BYTE.sub("", text))
    sparse = len(text) - dense + two_byte
    return math.ceil(sparse / chars_per_token + dense * DENSE_TOKENS_PER_CHAR)


def count_message_tokens(message: Mapping[str, Any], chars_per_token: float) -> int:
    return count_text_tokens(message_text(message), chars_per_token) + PER_MESSAGE_OVERHEAD


def count_tools_tokens(tools: Sequence[Any] | None, chars_per_token: float) -> int:
    return count_text_tokens(canonical_json(list(tools)), chars_per_token) if tools else 0


def count_prompt_tokens(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None,
    chars_per_token: float,
) -> int:
    """Deterministic prompt size: per message ceil(chars/cpt)+4, plus the offered tools."""
    total = sum(count_message_tokens(message, chars_per_token) for message in messages)
    return total + count_tools_tokens(tools, chars_per_token)


def count_completion_tokens(
    content: str,
    thinking: str,
    tool_calls: Sequence[Any] | None,
    chars_per_token: float,
) -> int:
    """Generated tokens; never zero, because a real model always emits at least EOS."""
    text = content + thinking + (canonical_json(list(tool_calls)) if tool_calls else "")
    return max(1, count_text_tokens(text, chars_per_token))


def truncate_to_fit(
    messages: Sequence[ChatMessage],
    tools: Sequence[Any] | None,
    num_ctx: int,
    chars_per_token: float,
) -> tuple[list[ChatMessage], int]:
    """Drop the oldest messages until the prompt fits ``num_ctx``, as Ollama silently does.

    Returns the kept messages and their token count. The newest message is always kept;
    if even it does not fit, the count is clamped to ``num_ctx`` because Ollama cuts the
    input tokens themselves rather than failing.
    """
    kept = list(messages)
    total = count_prompt_tokens(kept, tools, chars_per_token)
    while total > num_ctx and len(kept) > 1:
        total -= count_message_tokens(kept.pop(0), chars_per_token)
    return kept, min(total, num_ctx)


# --------------------------------------------------------------------------- request parsing


class BadRequest(Exception):
    """A client error; the text becomes the ``error`` field of an HTTP 400 answer."""


@dataclass
class ChatRequest:
    model: str
    messages: list[ChatMessage]
    tools: list[JSONObject]
    options: JSONObject
    stream: bool
    think: bool | str | None


def _check_optional_str(message: Mapping[str, Any], key: str, where: str) -> None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{where}.{key} must be a string")


def _check_tool_calls(value: Any, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise BadRequest(f"{where}.tool_calls must be a list")
    for index, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{index}].function.name must be a string")
        if not isinstance(function.get("arguments", {}), dict):
            raise BadRequest(f"{where}.tool_calls[{index}].function.arguments must be an object")


def parse_message(raw: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object")
    if raw.get("role") not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}")
    for key in ("content", "thinking", "tool_name"):
        _check_optional_str(raw, key, where)
    _check_tool_calls(raw.get("tool_calls"), where)
    return dict(raw)


def parse_messages(raw: Any) -> list[ChatMessage]:
    # Ollama treats absent messages as a "load the model" request, not as an error.
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("messages must be a list")
    return [parse_message(item, index) for index, item in enumerate(raw)]


def parse_options(raw: Any) -> JSONObject:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest("options must be an object")
    for key in ("num_ctx", "stub_summary_chars"):
        value = raw.get(key)
        if value is None:
            continue
        minimum = 1 if key == "num_ctx" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise BadRequest(f"options.{key} must be an integer >= {minimum}")
    # Ollama's answer limit: a positive count, or -1 (no limit) or -2 (fill the window).
    limit = raw.get("num_predict")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise BadRequest("options.num_predict must be an integer")
    return dict(raw)


def parse_tools(raw: Any) -> list[JSONObject]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(tool, dict) for tool in raw):
        raise BadRequest("tools must be a list of objects")
    return list(raw)


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required")
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    think = body.get("think")
    if think is not None and not isinstance(think, bool | str):
        raise BadRequest("think must be a boolean or a string")
    return ChatRequest(
        model=model,
        messages=parse_messages(body.get("messages")),
        tools=parse_tools(body.get("tools")),
        options=parse_options(body.get("options")),
        stream=stream,
        think=think,
    )


# --------------------------------------------------------------------------- reply rules


@dataclass
class Reply:
    content: str = ""
    thinking: str = ""
    tool_calls: list[JSONObject] = field(default_factory=list)


def filler_text(length: int, seed: int = 0) -> str:
    """Exactly ``length`` characters of space-led words; ``seed`` picks the first word."""
    if length <= 0:
        return ""
    words: list[str] = []
    size = 0
    index = seed
    while size < length:
        word = " " + FILLER_WORDS[index % len(FILLER_WORDS)]
        words.append(word)
        size += len(word)
        index += 1
    return "".join(words)[:length]


def _one_line(text: str) -> str:
    # Summary sections are one line each, so excerpts must not carry newlines.
    return " ".join(text.split())


def _fit(text: str, length: int, seed: int) -> str:
    """Cut or pad ``text`` to exactly ``length`` characters, deterministically."""
    text = _one_line(text)
    if len(text) >= length:
        return text[:length]
    return text + filler_text(length - len(text), seed)


def request_kind(request: ChatRequest) -> str:
    return "summary" if is_summary_request(request.messages) else "answer"


def is_summary_request(messages: Sequence[ChatMessage]) -> bool:
    return any(
        message["role"] == "system" and SUMMARY_MARKER in str(message.get("content") or "")
        for message in messages
    )


def transcript_user_text(text: str) -> str | None:
    """The first user turn of a transcript rendered as text, if the text is one."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        label = _TRANSCRIPT_USER_LABEL.match(line)
        if not label:
            continue
        if label.group(1).strip():
            return label.group(1)
        # A label on a line of its own: the turn runs until the next blank line.
        body = list(itertools.takewhile(str.strip, lines[index + 1 :]))
        if body:
            return "\n".join(body)
    return None


def summary_goal(conversation: Sequence[ChatMessage]) -> str:
    """What a model following the summary prompt would put under Goal.

    A quoted first request wins (``FIRST REQUEST`` section), then the Goal line
    of earlier notes being merged (so stacked summaries keep it), then the
    first user turn found: as a real message or in a rendered transcript with
    ``[user]`` / ``user:`` labels.
    """
    for pattern in (_FIRST_REQUEST, _EARLIER_GOAL):
        for message in conversation:
            found = pattern.search(str(message.get("content") or ""))
            if found:
                return found.group(1).strip()
    for message in conversation:
        content = str(message.get("content") or "")
        rendered = transcript_user_text(content)
        if rendered is not None:
            return rendered
        if message["role"] == "user":
            return content
    return ""


def summary_target_chars(conversation: Sequence[ChatMessage]) -> int:
    """About a tenth of the summarised text, within [80, 4000] characters."""
    total = sum(len(message_text(message)) for message in conversation)
    return max(SUMMARY_MIN_CHARS, min(SUMMARY_MAX_CHARS, round(total * 0.1)))


def _progress_text(conversation: Sequence[ChatMessage], digest: str) -> str:
    roles = [message["role"] for message in conversation]
    excerpts = [
        _one_line(message_text(message))[:60]
        for message in conversation
        if message["role"] in ("assistant", "tool")
    ]
    counts = ", ".join(f"{roles.count(role)} {role}" for role in ("user", "assistant", "tool"))
    return f"[{digest}] {len(conversation)} messages ({counts}); " + " | ".join(excerpts)


def build_summary(messages: Sequence[ChatMessage], exact_chars: int | None) -> str:
    """Structured Goal/Progress/Next step summary of the non-system messages.

    Its length is exactly ``exact_chars`` when given, else ``summary_target_chars``.
    """
    conversation = [m for m in messages if m["role"] != "system"]
    digest = hashlib.sha256(canonical_json(conversation).encode()).hexdigest()[:12]
    seed = int(digest, 16)
    if exact_chars is None:
        exact_chars = summary_directive(conversation)
    wanted = summary_target_chars(conversation) if exact_chars is None else exact_chars
    # Short requested lengths are cut from a minimal summary so the prefix stays structured.
    length = max(wanted, SUMMARY_MIN_CHARS)
    labels = ("Goal: ", "\nProgress: ", "\nNext step: ")
    budget = length - sum(len(label) for label in labels)
    # The goal gets up to 200 chars but leaves room for the other two sections.
    goal_chars = min(GOAL_MAX_CHARS, max(budget // 2, budget - 40))
    goal = _one_line(summary_goal(conversation))[:goal_chars]
    rest = budget - len(goal)
    next_chars = rest // 3
    last = _one_line(message_text(conversation[-1]))[:80] if conversation else "nothing yet"
    next_step = _fit(f"continue from: {last}", next_chars, seed + 7)
    progress = _fit(_progress_text(conversation, digest), rest - next_chars, seed)
    summary = f"{labels[0]}{goal}{labels[1]}{progress}{labels[2]}{next_step}"
    return summary[:wanted]


def summary_directive(conversation: Sequence[ChatMessage]) -> int | None:
    """The largest ``!summary N`` asked for in the text being summarised, if any."""
    asked = [int(found.group(1)) for message in conversation
             for found in _SUMMARY_DIRECTIVE.finditer(str(message.get("content") or ""))]
    return min(max(asked), LONG_MAX_CHARS) if asked else None


def offered_tool_names(tools: Sequence[JSONObject]) -> set[str]:
    names: set[str] = set()
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def _directive_arguments(text: str, position: int) -> JSONObject:
    """Decode the optional JSON object right after a ``!tool NAME`` directive."""
    rest = text[position:].lstrip()
    if not rest.startswith("{"):
        return {}
    try:
        value, _ = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_call_directives(
    messages: Sequence[ChatMessage], tools: Sequence[JSONObject]
) -> list[JSONObject]:
    """Tool calls asked for by ``!tool NAME {json}`` in the last message, if it is a
    user's, or in the last user message after a tool result when it says ``!toolloop``."""
    if not tools or not messages:
        return []
    last_user = next((m for m in reversed(messages) if m["role"] == "user"), None)
    if last_user is None:
        return []
    text = str(last_user.get("content") or "")
    looping = messages[-1]["role"] == "tool" and _TOOL_LOOP_DIRECTIVE in text
    if messages[-1]["role"] != "user" and not looping:
        return []
    names = offered_tool_names(tools)
    calls: list[JSONObject] = []
    for match in _TOOL_DIRECTIVE.finditer(text):
        if match.group(1) in names:
            arguments = _directive_arguments(text, match.end())
            calls.append({"function": {"name": match.group(1), "arguments": arguments}})
    return calls


def lead_text(messages: Sequence[ChatMessage]) -> str:
    """What the last user message's ``!lead "..."`` asks a tool call to say first."""
    last_user = next((m for m in reversed(messages) if m["role"] == "user"), None)
    found = _LEAD_DIRECTIVE.search(str(last_user.get("content") or "")) if last_user else None
    return found.group(1) if found else ""


def tool_results_reply(messages: Sequence[ChatMessage]) -> str:
    """Quote every tool result that arrived after the last assistant message."""
    results: list[str] = []
    for message in reversed(messages):
        if message["role"] == "assistant":
            break
        if message["role"] == "tool":
            results.append(str(message.get("content") or ""))
    return "tool results: " + "; ".join(reversed(results))


def echo_reply(messages: Sequence[ChatMessage]) -> str:
    users = [str(m.get("content") or "") for m in messages if m["role"] == "user"]
    last = users[-1] if users else ""
    reply = f"Echo: {last[:ECHO_MAX_CHARS]} (turn {len(users)})"
    extra = _LONG_DIRECTIVE.search(last)
    if extra:
        reply += filler_text(min(int(extra.group(1)), LONG_MAX_CHARS))
    return reply


def wants_thinking(think: bool | str | None) -> bool:
    # Ollama accepts true/false or an effort level ("low", "medium", "high").
    return think is True or (isinstance(think, str) and think not in ("", "false"))


def build_reply(request: ChatRequest, messages: Sequence[ChatMessage]) -> Reply:
    """Apply the reply rules, in priority order, to the messages left after truncation."""
    if is_summary_request(messages):
        exact = request.options.get("stub_summary_chars")
        reply = Reply(content=build_summary(messages, exact))
    elif calls := tool_call_directives(messages, request.tools):
        reply = Reply(content=lead_text(messages), tool_calls=calls)
    elif messages and messages[-1]["role"] == "tool":
        reply = Reply(content=tool_results_reply(messages))
    else:
        reply = Reply(content=echo_reply(messages))
    if wants_thinking(request.think):
        reply.thinking = f"Considering {len(messages)} message(s) before answering."
    return reply


def limit_to_num_predict(reply: Reply, num_predict: Any, chars_per_token: float) -> str:
    """Cut the answer at ``num_predict`` tokens as Ollama does, thinking first
    (it comes first); the done_reason: "length" when cut, else "stop"."""
    cpt = chars_per_token
    if not isinstance(num_predict, int) or num_predict <= 0:
        return "stop"  # -1: no limit; -2 (fill the window) is left to num_ctx
    if count_completion_tokens(reply.content, reply.thinking, reply.tool_calls, cpt) <= num_predict:
        return "stop"
    room = int(num_predict * cpt)
    reply.thinking = reply.thinking[:room]
    reply.content = reply.content[: room - len(reply.thinking)]
    reply.tool_calls = []  # a call cut in the middle is no call
    return "length"


def apply_empty_content_quirk(reply: Reply) -> None:
    """Some models answer only in the thinking channel; callers must cope with it."""
    if reply.content:
        reply.thinking = f"{reply.thinking}\n{reply.content}" if reply.thinking else reply.content
        reply.content = ""


# --------------------------------------------------------------------------- state and stats


@dataclass
class ModelStats:
    requests: int = 0
    max_prompt_tokens: int = 0
    truncated: int = 0

    def as_json(self) -> JSONObject:
        return {
            "requests": self.requests,
            "max_prompt_tokens": self.max_prompt_tokens,
            "truncated": self.truncated,
        }


@dataclass
class StubState:
    config: StubConfig
    totals: ModelStats = field(default_factory=ModelStats)
    per_model: dict[str, ModelStats] = field(default_factory=dict)
    # Insertion-ordered set of every model asked for, for /api/tags; survives resets.
    seen_models: dict[str, None] = field(default_factory=dict)
    # Per normalised model: the previous request's (tools, messages) fingerprints.
    prompt_cache: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    # Set when the server is asked to exit, to release requests of the "hang" quirk.
    shutdown_event: asyncio.Event = field(default_factory=asyncio.Event)
    # Set, and replaced by a fresh one, on every config change: held requests wait on it.
    config_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Streamed answers whose client went away before their end (a stopped
    # answer): each one's generation ended there.
    streams_cut: int = 0

    def announce_config_change(self) -> None:
        changed, self.config_changed = self.config_changed, asyncio.Event()
        changed.set()
    slots: ModelSlots = field(init=False)
    loads: ModelLoads = field(init=False)

    def __post_init__(self) -> None:
        self.slots = ModelSlots(self.config.models.parallel)
        self.loads = ModelLoads(self.config.models.load_ms)

    def stats_json(self) -> JSONObject:
        stats = self.totals.as_json()
        stats["models"] = {name: entry.as_json() for name, entry in self.per_model.items()}
        stats["streams_cut"] = self.streams_cut
        return stats

    def reset(self) -> None:
        self.totals = ModelStats()
        self.per_model.clear()
        self.prompt_cache.clear()
        self.streams_cut = 0

    def record_prompt(self, model: str, prompt_tokens: int, truncated: bool) -> None:
        """Per-model bookkeeping; the total request count is taken on arrival instead."""
        entry = self.per_model.setdefault(model, ModelStats())
        entry.requests += 1
        self.seen_models.setdefault(normalize_model(model), None)
        for stats in (entry, self.totals):
            stats.max_prompt_tokens = max(stats.max_prompt_tokens, prompt_tokens)
            stats.truncated += int(truncated)


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


# --------------------------------------------------------------------------- responses


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


async def _sleep_ns(seconds: float) -> int:
    """Sleep at least `seconds` (uvloop's millisecond timers may wake a little
    early) and return how long it was."""
    started = time.perf_counter_ns()
    if seconds > 0:
        await asyncio.sleep(seconds)
        short = started + int(seconds * 1e9) - time.perf_counter_ns()
        if short > 0:
            await asyncio.sleep(short / 1e9 + 0.001)
    return time.perf_counter_ns() - started


async def stream_chat(generation: Generation, state: StubState) -> AsyncIterator[bytes]:
    """NDJSON chunks; the per-token latency is spread evenly over the pieces.
    A client that goes away ends the generation, as with Ollama."""
    finished = False
    try:
        async for chunk in _chunks(generation):
            yield chunk
        finished = True
    finally:
        if not finished:
            state.streams_cut += 1


async def _chunks(generation: Generation) -> AsyncIterator[bytes]:
    load_ns = await _sleep_ns(generation.latency_s)
    pieces = stream_messages(generation.reply)
    total_s = generation.per_token_s * generation.eval_count
    eval_started = time.perf_counter_ns()
    if not pieces:
        await _sleep_ns(total_s)
    for message in pieces:
        await _sleep_ns(total_s / len(pieces))
        yield _ndjson(chat_chunk(generation.model, message, done=False))
    final = chat_chunk(generation.model, {"role": "assistant", "content": ""}, done=True)
    final.update(generation.final_fields(load_ns, time.perf_counter_ns() - eval_started))
    yield _ndjson(final)


def _ndjson(obj: JSONObject) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def complete_chat(generation: Generation) -> JSONObject:
    load_ns = await _sleep_ns(generation.latency_s)
    eval_ns = await _sleep_ns(generation.per_token_s * generation.eval_count)
    answer = chat_chunk(generation.model, reply_message(generation.reply), done=True)
    answer.update(generation.final_fields(load_ns, eval_ns))
    return answer


def load_response(model: str) -> JSONResponse:
    # What Ollama answers to a chat request without messages: it just loads the model.
    answer = chat_chunk(model, {"role": "assistant", "content": ""}, done=True)
    answer["done_reason"] = "load"
    return JSONResponse(answer)


# --------------------------------------------------------------------------- handlers


def _state(request: Request) -> StubState:
    state: StubState = request.app.state.stub
    return state


async def _read_json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both land here
        raise BadRequest(f"request body is not valid JSON: {exc}") from None


async def _next_disconnect(request: Request) -> None:
    # The body has been read, so the server's next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_of(*awaitables: Awaitable[Any]) -> None:
    """Return when the first of these ends; the others are cancelled."""
    waiters = {asyncio.ensure_future(a) for a in awaitables}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def wait_until_disconnected(request: Request, state: StubState) -> None:
    """Simulate a wedged model: never answer, but let the client or a shutdown end it."""
    await first_of(_next_disconnect(request), state.shutdown_event.wait())


async def wait_while_held(state: StubState, model: str) -> None:
    """Keep a request for a held model waiting until the model is let go, or the
    stand-in exits."""
    while state.config.holds(model) and not state.shutdown_event.is_set():
        await first_of(state.config_changed.wait(), state.shutdown_event.wait())


def receive_prompt(state: StubState, request: ChatRequest) -> tuple[list[ChatMessage], int]:
    """Record the prompt as received, then truncate it as Ollama would.

    Recording comes first so the stats show the untruncated size, under every quirk.
    """
    config = state.config
    num_ctx = request.options.get("num_ctx") or config.default_num_ctx
    received = count_prompt_tokens(request.messages, request.tools, config.chars_per_token)
    state.record_prompt(request.model, received, truncated=received > num_ctx)
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
    kept, prompt_tokens = receive_prompt(state, chat)
    loading_ns = await state.loads.ensure_loaded(chat.model)
    if not chat.messages:
        return load_response(chat.model)
    if "error" in state.config.quirks:
        return error_response(500, ERROR_TEXT)
    if "hang" in state.config.quirks:
        await wait_until_disconnected(request, state)
        return error_response(503, "stub: hang ended")
    state.slots.note(chat.model, "arrived", request_kind(chat))
    await wait_while_held(state, chat.model)
    generation = prepare_generation(state, chat, kept, prompt_tokens, started_ns)
    generation.loading_ns = loading_ns
    return await answer_in_slot(state, chat, generation)


async def answer_in_slot(state: StubState, chat: ChatRequest, generation: Generation) -> Response:
    """The answer, produced while holding one of the model's parallel slots."""
    slot = await state.slots.take(chat.model, request_kind(chat))
    if chat.stream:
        # The background task frees the slot even if the client left before the stream began.
        return StreamingResponse(held_stream(stream_chat(generation, state), slot),
                                 media_type="application/x-ndjson",
                                 background=BackgroundTask(slot.release))
    try:
        whole = await complete_chat(generation)
        slot.first_chunk()  # the whole answer is its first chunk
        return JSONResponse(whole)
    finally:
        slot.release()


def model_details() -> JSONObject:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": "stub",
        "families": ["stub"],
        "parameter_size": "1B",
        "quantization_level": "Q4_0",
    }


def model_entry(name: str) -> JSONObject:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return {
        "name": name,
        "model": name,
        "modified_at": FIXED_TIMESTAMP,
        "size": 1_000_000 + int(digest[:5], 16),
        "digest": digest,
        "details": model_details(),
    }


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


def _number(value: Any, key: str, positive: bool) -> float:
    bound_ok = isinstance(value, int | float) and (value > 0 if positive else value >= 0)
    if isinstance(value, bool) or not bound_ok:
        raise BadRequest(f"{key} must be a number {'> 0' if positive else '>= 0'}")
    return float(value)


def _quirk_list(value: Any) -> set[str]:
    if not isinstance(value, list) or not all(isinstance(q, str) for q in value):
        raise BadRequest("quirks must be a list of strings")
    unknown = sorted(set(value) - set(QUIRKS))
    if unknown:
        raise BadRequest(f"unknown quirk(s) {unknown}; known: {', '.join(QUIRKS)}")
    return set(value)


def _latency_map(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise BadRequest("model_latency must be an object of model name -> milliseconds")
    return {str(name): _number(ms, f"model_latency[{name}]", False) for name, ms in value.items()}


def _model_set(value: Any) -> set[str]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise BadRequest("held_models must be a list of model names")
    return set(value)


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{key} must be an integer >= 1")
    return value


def apply_config_update(config: StubConfig, body: Any) -> None:
    """Validate the whole update first, then apply it, so a bad field changes nothing."""
    if not isinstance(body, dict):
        raise BadRequest("config body must be a JSON object")
    known = {"quirks", "ms_per_token", "model_latency", "chars_per_token", "default_num_ctx",
             "held_models"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown config key(s) {unknown}; known: {', '.join(sorted(known))}")
    updates: JSONObject = {}
    if "quirks" in body:
        updates["quirks"] = _quirk_list(body["quirks"])
    if "ms_per_token" in body:
        updates["ms_per_token"] = _number(body["ms_per_token"], "ms_per_token", False)
    if "chars_per_token" in body:
        updates["chars_per_token"] = _number(body["chars_per_token"], "chars_per_token", True)
    if "model_latency" in body:
        updates["model_latency"] = _latency_map(body["model_latency"])
    if "default_num_ctx" in body:
        updates["default_num_ctx"] = _positive_int(body["default_num_ctx"], "default_num_ctx")
    if "held_models" in body:
        updates["held_models"] = _model_set(body["held_models"])
    for key, value in updates.items():
        setattr(config, key, value)


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


# --------------------------------------------------------------------------- models

DEFAULT_CAPABILITIES = ("completion", "tools")
KNOWN_CAPABILITIES = ("completion", "tools", "thinking", "vision", "insert", "embedding")
DEFAULT_CONTEXT_LENGTH = 131072
# A pull streams this many progress lines per layer, as Ollama reports a download.
PULL_STEPS = 4
PULL_LAYER_BYTES = 4_000_000


@dataclass
class ModelCatalogue:
    """Which models the stand-in has and what each can do (``--models``,
    ``--capabilities``, ``--context-length``, ``--parallel``, ``--load-ms``).

    Names are normalised (``name`` is ``name:latest``). ``served`` None means any
    name is there, as before these flags existed.
    """

    served: set[str] | None = None
    capabilities: dict[str, tuple[str, ...]] = field(default_factory=dict)
    context_length: dict[str, int] = field(default_factory=dict)
    parallel: int | None = None
    load_ms: float = 0.0
    # Older Ollama releases describe no capabilities in /api/show.
    show_capabilities: bool = True

    def has(self, model: str) -> bool:
        return self.served is None or normalize_model(model) in self.served

    def capabilities_of(self, model: str) -> tuple[str, ...]:
        return self.capabilities.get(normalize_model(model), DEFAULT_CAPABILITIES)

    def context_length_of(self, model: str) -> int:
        return self.context_length.get(normalize_model(model), DEFAULT_CONTEXT_LENGTH)

    def pulled(self, model: str) -> None:
        if self.served is not None:
            self.served.add(normalize_model(model))


def not_found_text(model: str) -> str:
    return f'model "{model}" not found, try pulling it first'


def model_refusal(catalogue: ModelCatalogue, request: ChatRequest) -> JSONResponse | None:
    """Ollama's answer to a chat request the model cannot take, if any: 404 for a
    model that is not there, 400 for tools offered to a model without them."""
    if not catalogue.has(request.model):
        return error_response(404, not_found_text(request.model))
    if request.tools and "tools" not in catalogue.capabilities_of(request.model):
        return error_response(400, f"{request.model} does not support tools")
    # Only for a model described by --capabilities: without the flag, any model
    # thinks when asked, as this stand-in always let it.
    described = normalize_model(request.model) in catalogue.capabilities
    lacks = "thinking" not in catalogue.capabilities_of(request.model)
    if described and lacks and wants_thinking(request.think):
        return error_response(400, f'"{request.model}" does not support thinking')
    return None


def thinks(catalogue: ModelCatalogue, request: ChatRequest) -> bool:
    """A thinking model thinks unless told ``think: false``; other models only when asked."""
    if "thinking" in catalogue.capabilities_of(request.model):
        return request.think is not False and request.think != "false"
    return wants_thinking(request.think)


def apply_thinking(catalogue: ModelCatalogue, request: ChatRequest, reply: Reply,
                   messages: Sequence[ChatMessage]) -> None:
    """What a thinking model does with its output budget. Asked for a summary
    while thinking, it spends the whole output on thinking and the content
    stays empty, as qwen3 and its kind do on long inputs."""
    if not thinks(catalogue, request):
        reply.thinking = ""
        return
    if not reply.thinking:
        reply.thinking = f"Considering {len(messages)} message(s) before answering."
    if "thinking" in catalogue.capabilities_of(request.model) and is_summary_request(messages):
        reply.thinking = f"{reply.thinking}\nDrafting: {reply.content}"
        reply.content = ""


class ModelSlots:
    """At most ``parallel`` requests in progress per model; the rest wait in
    arrival order (asyncio's semaphore is fair), as OLLAMA_NUM_PARALLEL does.

    ``log`` keeps, in order, when each chat request arrived, got a slot, sent
    its first chunk and gave its slot back, and whether it was a summary or an
    answer: which request waited behind which, without reading any clock."""

    def __init__(self, parallel: int | None) -> None:
        self._parallel = parallel
        self._slots: dict[str, asyncio.Semaphore] = {}
        self.waiting: dict[str, int] = {}
        self.busy: dict[str, int] = {}
        self.log: deque[JSONObject] = deque(maxlen=SLOT_LOG_LENGTH)

    def note(self, model: str, event: str, kind: str) -> None:
        self.log.append({"model": normalize_model(model), "event": event, "kind": kind,
                         "at_s": time.monotonic()})

    async def take(self, model: str, kind: str = "answer") -> Slot:
        key = normalize_model(model)
        if self._parallel is not None:
            semaphore = self._slots.setdefault(key, asyncio.Semaphore(self._parallel))
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                await semaphore.acquire()
            finally:
                self.waiting[key] -= 1
        self.busy[key] = self.busy.get(key, 0) + 1
        self.note(key, "started", kind)
        return Slot(self, key, kind)

    def give_back(self, key: str, kind: str) -> None:
        self.busy[key] -= 1
        self.note(key, "done", kind)
        if self._parallel is not None:
            self._slots[key].release()

    def as_json(self) -> JSONObject:
        return {"parallel": self._parallel, "waiting": dict(self.waiting),
                "in_progress": dict(self.busy), "log": list(self.log)}


class Slot:
    """One request's place; given back once, however its response ends."""

    def __init__(self, slots: ModelSlots, key: str, kind: str) -> None:
        self._slots: ModelSlots | None = slots
        self._key = key
        self.kind = kind
        self._first_chunk = True

    def first_chunk(self) -> None:
        if self._first_chunk and self._slots is not None:
            self._first_chunk = False
            self._slots.note(self._key, "first_chunk", self.kind)

    def release(self) -> None:
        if self._slots is not None:
            self._slots.give_back(self._key, self.kind)
            self._slots = None


async def slots_endpoint(request: Request) -> Response:
    return JSONResponse(_state(request).slots.as_json())


class ModelLoads:
    """The first call to a model loads it (``--load-ms``); calls arriving while it
    loads wait for the same load, as they do in Ollama."""

    def __init__(self, load_ms: float) -> None:
        self._load_s = load_ms / 1000
        self._loads: dict[str, asyncio.Future[int]] = {}

    async def ensure_loaded(self, model: str) -> int:
        """Nanoseconds this request waited for the model to load (0 once loaded)."""
        if self._load_s <= 0:
            return 0
        key = normalize_model(model)
        load = self._loads.get(key)
        if load is None:
            load = self._loads[key] = asyncio.ensure_future(_sleep_ns(self._load_s))
        if load.done():
            return 0
        started = time.perf_counter_ns()
        await asyncio.shield(load)
        return time.perf_counter_ns() - started


async def held_stream(chunks: AsyncIterator[bytes], slot: Slot) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            slot.first_chunk()
            yield chunk
    finally:
        slot.release()


def show_answer(catalogue: ModelCatalogue, model: str, default_num_ctx: int) -> JSONObject:
    answer: JSONObject = {
        "modelfile": f"# Modelfile generated by the ollama stand-in\nFROM {model}\n",
        "parameters": f"num_ctx                        {default_num_ctx}",
        "template": "{{ .System }}\n{{ .Prompt }}",
        "details": model_details(),
        "model_info": {"general.architecture": "stub",
                       "stub.context_length": catalogue.context_length_of(model)},
        "capabilities": list(catalogue.capabilities_of(model)),
        "modified_at": FIXED_TIMESTAMP,
    }
    if not catalogue.show_capabilities:
        del answer["capabilities"]
    return answer


def pull_progress(model: str) -> list[JSONObject]:
    """The status lines of ``ollama pull``: manifest, one layer's download, checks, success."""
    digest = "sha256:" + hashlib.sha256(model.encode()).hexdigest()
    lines: list[JSONObject] = [{"status": "pulling manifest"}]
    for step in range(PULL_STEPS + 1):
        lines.append({"status": f"pulling {digest[7:19]}", "digest": digest,
                      "total": PULL_LAYER_BYTES,
                      "completed": PULL_LAYER_BYTES * step // PULL_STEPS})
    lines += [{"status": "verifying sha256 digest"}, {"status": "writing manifest"},
              {"status": "success"}]
    return lines


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
    return StreamingResponse(_ndjson_lines(lines), media_type="application/x-ndjson")


async def _ndjson_lines(lines: Sequence[JSONObject]) -> AsyncIterator[bytes]:
    for line in lines:
        await asyncio.sleep(0)
        yield _ndjson(line)


def listed_models(state: StubState) -> list[str]:
    served = state.config.models.served
    if served is None:
        return list(dict.fromkeys([STUB_MODEL, *state.seen_models]))
    return sorted(served)


def _named_list_arg(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, values = text.partition("=")
    capabilities = tuple(v.strip() for v in values.split(",") if v.strip())
    unknown = sorted(set(capabilities) - set(KNOWN_CAPABILITIES))
    if not sep or not name or unknown:
        raise argparse.ArgumentTypeError(
            f"expected NAME=CAP[,CAP...] of {', '.join(KNOWN_CAPABILITIES)}, got {text!r}")
    return normalize_model(name), capabilities


def _named_int_arg(text: str) -> tuple[str, int]:
    name, sep, number = text.partition("=")
    if not sep or not name or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=N with N >= 1, got {text!r}")
    return normalize_model(name), int(number)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models", default=None, metavar="NAME[,NAME...]",
        help="the models that are there; others answer 404 (default: any name)")
    parser.add_argument(
        "--capabilities", type=_named_list_arg, action="append", default=[],
        metavar="NAME=CAP,...", help="a model's capabilities (default: completion,tools)")
    parser.add_argument(
        "--context-length", type=_named_int_arg, action="append", default=[],
        metavar="NAME=N", help=f"a model's trained window (default: {DEFAULT_CONTEXT_LENGTH})")
    parser.add_argument("--parallel", type=_positive_int_arg, default=None,
                        help="requests in progress at once per model; the rest queue")
    parser.add_argument("--load-ms", type=_non_negative_float_arg, default=0.0,
                        help="extra time of the first call to each model (loading it)")
    parser.add_argument("--show-without-capabilities", action="store_true",
                        help="leave capabilities out of /api/show, as older Ollama releases do")


def catalogue_from_args(args: argparse.Namespace) -> ModelCatalogue:
    served = None
    if args.models is not None:
        served = {normalize_model(n.strip()) for n in args.models.split(",") if n.strip()}
    return ModelCatalogue(served=served, capabilities=dict(args.capabilities),
                          context_length=dict(args.context_length),
                          parallel=args.parallel, load_ms=args.load_ms,
                          show_capabilities=not args.show_without_capabilities)


# --------------------------------------------------------------------------- command line


class _StubServer(uvicorn.Server):
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


def _model_latency_arg(text: str) -> tuple[str, float]:
    name, sep, millis = text.partition("=")
    try:
        value = float(millis)
    except ValueError:
        value = -1.0
    if not sep or not name or value < 0:
        raise argparse.ArgumentTypeError(f"expected NAME=MS with MS >= 0, got {text!r}")
    return name, value


def _positive_float_arg(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def _non_negative_float_arg(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def _positive_int_arg(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Deterministic Ollama-compatible stand-in.")
    parser.add_argument("--port", type=int, default=11435, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--chars-per-token", type=_positive_float_arg, default=4.0)
    parser.add_argument("--ms-per-token", type=_non_negative_float_arg, default=0.0)
    parser.add_argument(
        "--model-latency", type=_model_latency_arg, action="append", default=[],
        metavar="NAME=MS", help="fixed extra latency per request for a model (repeatable)",
    )  # fmt: skip
    parser.add_argument("--quirk", choices=QUIRKS, action="append", default=[])
    parser.add_argument("--default-num-ctx", type=_positive_int_arg, default=2048)
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    add_model_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> StubConfig:
    return StubConfig(
        host=args.host,
        port=args.port,
        chars_per_token=args.chars_per_token,
        ms_per_token=args.ms_per_token,
        model_latency=dict(args.model_latency),
        quirks=set(args.quirk),
        default_num_ctx=args.default_num_ctx,
        models=catalogue_from_args(args),
    )


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    sock = bind_socket(config.host, config.port)
    config.port = sock.getsockname()[1]
    app = build_app(config)
    server = _StubServer(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            access_log=False,
            # Backstop for slow streams still running at shutdown.
            timeout_graceful_shutdown=2,
        ),
        app.state.stub,
    )
    shown_host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"ollama stand-in listening on http://{shown_host}:{config.port}", flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
