"""Parsing and validation of an ``/api/chat`` body; a bad one is a ``BadRequest``
(an HTTP 400 with an ``error`` text, as Ollama answers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .common import ChatMessage, JSONObject

ROLES = ("system", "user", "assistant", "tool")


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
    # False: a prompt longer than the window is refused (400), not cut to fit
    # (Ollama 0.12.6 and later; earlier ones ignore the field and cut).
    truncate: bool = True


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
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise BadRequest("truncate must be a boolean")
    return ChatRequest(
        model=model,
        messages=parse_messages(body.get("messages")),
        tools=parse_tools(body.get("tools")),
        options=parse_options(body.get("options")),
        stream=stream,
        think=think,
        truncate=truncate,
    )
