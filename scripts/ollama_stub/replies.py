"""The reply rules: what the stand-in answers, decided from the input alone.

A summary for a compaction prompt, tool calls asked for by ``!tool NAME {json}``
(with ``!lead "..."`` and ``!toolloop``), a quote of tool results, else an echo of
the last user message (``!long N`` appends N characters of filler). ``!summary N``
in summarised text asks for a summary of exactly N characters. Then the cut at
``num_predict``."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat_request import ChatRequest
from .common import ChatMessage, JSONObject, canonical_json
from .tokens import count_completion_tokens, message_text

SUMMARY_MARKER = "COMPACTION SUMMARY"
SUMMARY_MIN_CHARS = 80
SUMMARY_MAX_CHARS = 4000
GOAL_MAX_CHARS = 200
ECHO_MAX_CHARS = 120
# Keeps a mistyped "!long" from exhausting memory.
LONG_MAX_CHARS = 2_000_000
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
