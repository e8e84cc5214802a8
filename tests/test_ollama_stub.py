"""Tests of the Ollama stand-in, driven through the real ``ollama.AsyncClient``.

One stub process serves the whole module; every test starts from the default
configuration and zeroed statistics (``/_stub/config`` + ``/_stub/reset``).
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from scripts.ollama_stub import (
    StubConfig,
    build_app,
    count_completion_tokens,
    count_prompt_tokens,
    truncate_to_fit,
)

# Like scripts.ollama_stub, this needs the repo root on sys.path (python -m pytest does it).
from tests.events import eventually, until
from tests.stub_server import REPO_ROOT, running_stub

DEFAULT_CONFIG: dict[str, Any] = {
    "quirks": [],
    "ms_per_token": 0,
    "model_latency": {},
    "chars_per_token": 4.0,
    "default_num_ctx": 2048,
    "held_models": [],
    "paused_models": [],
}
MODEL = "test-model"
WORD_COUNT_TOOL = {
    "type": "function",
    "function": {
        "name": "word_count",
        "description": "Count the words of a text.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "The text."}},
            "required": ["text"],
        },
    },
}
ECHO_TOOL = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echo the arguments.",
        "parameters": {"type": "object", "properties": {}},
    },
}


# --------------------------------------------------------------------------- fixtures


@functools.cache
def control() -> httpx.Client:
    """One reused client for the control endpoints: a fresh one per call costs ~20 ms."""
    return httpx.Client(timeout=10)


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    with running_stub() as url:
        yield url
    control().close()
    control.cache_clear()


@pytest.fixture(autouse=True)
def clean_stub(stub_url: str) -> None:
    configure(stub_url, **DEFAULT_CONFIG)
    control().post(f"{stub_url}/_stub/reset").raise_for_status()


def configure(url: str, **settings: Any) -> dict[str, Any]:
    response = control().post(f"{url}/_stub/config", json=settings)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def stats(url: str) -> dict[str, Any]:
    result: dict[str, Any] = control().get(f"{url}/_stub/stats").json()
    return result


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def chat(url: str, messages: list[dict[str, Any]], **kwargs: Any) -> ollama.ChatResponse:
    kwargs.setdefault("model", MODEL)
    async with ollama.AsyncClient(host=url) as client:
        response: ollama.ChatResponse = await client.chat(messages=messages, **kwargs)
    return response


async def stream_parts(
    url: str, messages: list[dict[str, Any]], **kwargs: Any
) -> list[ollama.ChatResponse]:
    kwargs.setdefault("model", MODEL)
    async with ollama.AsyncClient(host=url) as client:
        stream = await client.chat(messages=messages, stream=True, **kwargs)
        return [part async for part in stream]


def joined_content(parts: list[ollama.ChatResponse]) -> str:
    return "".join(part.message.content or "" for part in parts)


# --------------------------------------------------------------------------- tokenizer (pure)


def test_tokenizer_counts_content_tool_calls_thinking_and_tools() -> None:
    call = [{"function": {"name": "f", "arguments": {"b": 1, "a": "x"}}}]
    call_json = '[{"function":{"arguments":{"a":"x","b":1},"name":"f"}}]'
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "12345678"},  # 2 tokens + 4
        {"role": "assistant", "content": "", "tool_calls": call, "thinking": "abc"},
    ]
    expected = (2 + 4) + (math.ceil((len(call_json) + 3) / 4) + 4)
    assert count_prompt_tokens(messages, None, 4.0) == expected
    tools = [WORD_COUNT_TOOL]
    tools_json_len = (
        len(
            '{"function":{"description":"Count the words of a text.","name":"word_count",'
            '"parameters":{"properties":{"text":{"description":"The text.","type":"string"}},'
            '"required":["text"],"type":"object"}},"type":"function"}'
        )
        + 2
    )  # the surrounding list brackets
    assert count_prompt_tokens(messages, tools, 4.0) == expected + math.ceil(tools_json_len / 4)
    assert count_prompt_tokens(messages, None, 2.0) > expected
    assert count_completion_tokens("", "", None, 4.0) == 1
    assert count_completion_tokens("abcde", "fg", None, 4.0) == 2


def test_truncate_to_fit_drops_oldest_first() -> None:
    messages = [
        {"role": "system", "content": "s" * 40},
        user("u" * 40),
        {"role": "assistant", "content": "a" * 40},
        user("last"),
    ]
    kept, tokens = truncate_to_fit(messages, None, 30, 4.0)
    assert kept == messages[2:]
    assert tokens == count_prompt_tokens(kept, None, 4.0) <= 30


# --------------------------------------------------------------------------- chat basics


@pytest.mark.asyncio
async def test_non_streaming_chat_echoes_and_counts_tokens(stub_url: str) -> None:
    messages = [{"role": "system", "content": "You are terse."}, user("hello world")]
    response = await chat(stub_url, messages)
    content = "Echo: hello world (turn 1)"
    assert response.message.role == "assistant"
    assert response.message.content == content
    assert response.done is True
    assert response.done_reason == "stop"
    assert response.model == MODEL
    assert response.prompt_eval_count == count_prompt_tokens(messages, None, 4.0)
    assert response.eval_count == math.ceil(len(content) / 4)
    for duration in (
        response.total_duration,
        response.load_duration,
        response.prompt_eval_duration,
        response.eval_duration,
    ):
        assert isinstance(duration, int)
    assert response.message.thinking is None
    assert response.message.tool_calls is None


@pytest.mark.asyncio
async def test_streaming_chat_chunks_then_final_with_counts(stub_url: str) -> None:
    messages = [user("one two three"), {"role": "assistant", "content": "ok"}, user("four")]
    parts = await stream_parts(stub_url, messages)
    assert len(parts) > 3
    assert all(part.done is False for part in parts[:-1])
    final = parts[-1]
    assert final.done is True and final.done_reason == "stop"
    assert final.message.content == ""
    content = joined_content(parts)
    assert content == "Echo: four (turn 2)"
    assert final.prompt_eval_count == count_prompt_tokens(messages, None, 4.0)
    assert final.eval_count == count_completion_tokens(content, "", None, 4.0)
    assert parts[0].prompt_eval_count is None  # counts only arrive with the final chunk


@pytest.mark.asyncio
async def test_replies_are_deterministic_and_depend_on_input(stub_url: str) -> None:
    first = await chat(stub_url, [user("same question")])
    again = await chat(stub_url, [user("same question")])
    other = await chat(stub_url, [user("another question")])
    assert first.message.content == again.message.content
    assert first.prompt_eval_count == again.prompt_eval_count
    assert first.eval_count == again.eval_count
    assert other.message.content != first.message.content
    long_text = "x" * 300
    clipped = await chat(stub_url, [user(long_text)])
    assert clipped.message.content == f"Echo: {'x' * 120} (turn 1)"


@pytest.mark.asyncio
async def test_long_directive_appends_filler(stub_url: str) -> None:
    text = "make it big !long 500"
    response = await chat(stub_url, [user(text)])
    base = f"Echo: {text} (turn 1)"
    assert response.message.content is not None
    assert response.message.content.startswith(base)
    assert len(response.message.content) == len(base) + 500
    parts = await stream_parts(stub_url, [user(text)])
    assert joined_content(parts) == response.message.content
    assert len(parts) > 50  # streamed word by word


@pytest.mark.asyncio
async def test_think_adds_thinking(stub_url: str) -> None:
    response = await chat(stub_url, [user("hm")], think=True)
    assert response.message.thinking
    assert response.message.content == "Echo: hm (turn 1)"


@pytest.mark.asyncio
async def test_empty_messages_is_a_load_request(stub_url: str) -> None:
    response = await chat(stub_url, [])
    assert response.done is True
    assert response.done_reason == "load"
    assert response.message.content == ""


# --------------------------------------------------------------------------- tools


@pytest.mark.asyncio
async def test_tool_call_round_trip(stub_url: str) -> None:
    tools = [WORD_COUNT_TOOL]
    messages = [user('please count !tool word_count {"text": "a b"}')]
    first = await chat(stub_url, messages, tools=tools)
    assert first.message.content == ""
    assert first.message.tool_calls is not None
    assert len(first.message.tool_calls) == 1
    call = first.message.tool_calls[0]
    assert call.function.name == "word_count"
    assert dict(call.function.arguments) == {"text": "a b"}
    assert first.eval_count is not None and first.eval_count > 1

    messages += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "word_count", "arguments": {"text": "a b"}}}],
        },
        {"role": "tool", "content": "2", "tool_name": "word_count"},
    ]
    second = await chat(stub_url, messages, tools=tools)
    assert second.message.content == "tool results: 2"
    assert second.message.tool_calls is None


@pytest.mark.asyncio
async def test_a_tool_call_can_write_text_before_its_calls(stub_url: str) -> None:
    messages = [user('!lead "Let me check" !tool word_count {"text": "a b"}')]
    first = await chat(stub_url, messages, tools=[WORD_COUNT_TOOL])
    assert first.message.content == "Let me check"
    assert first.message.tool_calls is not None and len(first.message.tool_calls) == 1


@pytest.mark.asyncio
async def test_tool_directive_variants(stub_url: str) -> None:
    tools = [WORD_COUNT_TOOL, ECHO_TOOL]
    several = await chat(
        stub_url,
        [user('!tool echo then !tool word_count {"text": "x"} !tool unknown')],
        tools=tools,
    )
    assert several.message.tool_calls is not None
    assert [c.function.name for c in several.message.tool_calls] == ["echo", "word_count"]
    assert dict(several.message.tool_calls[0].function.arguments) == {}

    not_offered = await chat(stub_url, [user("!tool unknown")], tools=tools)
    assert not_offered.message.tool_calls is None
    no_tools = await chat(stub_url, [user('!tool word_count {"text": "x"}')])
    assert no_tools.message.content == 'Echo: !tool word_count {"text": "x"} (turn 1)'

    results = await chat(
        stub_url,
        [
            user("go"),
            {"role": "tool", "content": "stale"},
            {"role": "assistant", "content": "", "tool_calls": several.message.tool_calls},
            {"role": "tool", "content": "first", "tool_name": "echo"},
            {"role": "tool", "content": "second", "tool_name": "word_count"},
        ],
        tools=tools,
    )
    assert results.message.content == "tool results: first; second"

    parts = await stream_parts(stub_url, [user("!tool echo")], tools=tools)
    calls = [c for part in parts for c in (part.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["echo"]
    assert parts[-1].done is True


# --------------------------------------------------------------------------- model endpoints


@pytest.mark.asyncio
async def test_tags_version_and_show(stub_url: str) -> None:
    async with ollama.AsyncClient(host=stub_url) as client:
        names = [model.model for model in (await client.list()).models]
        assert "stub-model:latest" in names
        await chat(stub_url, [user("hi")], model="fresh-model")
        listed = (await client.list()).models
        shown = await client.show("fresh-model")
    fresh = [model for model in listed if model.model == "fresh-model:latest"]
    assert len(fresh) == 1
    assert fresh[0].details is not None and fresh[0].details.family == "stub"
    assert fresh[0].digest and fresh[0].size

    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "stub"
    assert shown.modelinfo["stub.context_length"] == 131072
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelfile and shown.template is not None

    async with httpx.AsyncClient(base_url=stub_url) as http:
        assert (await http.get("/api/version")).json() == {"version": "0.0.0-stub"}
        assert (await http.post("/api/show", json={})).status_code == 400


# --------------------------------------------------------------------------- token accounting


@pytest.mark.asyncio
async def test_chars_per_token_changes_counts(stub_url: str) -> None:
    messages = [user("a fairly ordinary sentence for counting")]
    at_four = await chat(stub_url, messages)
    configure(stub_url, chars_per_token=2.0)
    at_two = await chat(stub_url, messages)
    assert at_two.prompt_eval_count == count_prompt_tokens(messages, None, 2.0)
    assert at_four.prompt_eval_count is not None and at_two.prompt_eval_count is not None
    assert at_two.prompt_eval_count > at_four.prompt_eval_count
    assert at_two.message.content is not None
    assert at_two.eval_count == math.ceil(len(at_two.message.content) / 2)


@pytest.mark.asyncio
async def test_truncation_with_small_num_ctx(stub_url: str) -> None:
    messages = [
        {"role": "system", "content": "s" * 200},
        user("first " * 20),
        {"role": "assistant", "content": "answer " * 20},
        user("latest question"),
    ]
    full = count_prompt_tokens(messages, None, 4.0)
    response = await chat(stub_url, messages, options={"num_ctx": 64})
    assert response.prompt_eval_count is not None
    assert response.prompt_eval_count <= 64
    # The system prompt and the first user turn are gone, so this is turn 1 now.
    assert response.message.content == "Echo: latest question (turn 1)"
    current = stats(stub_url)
    assert current["requests"] == 1
    assert current["max_prompt_tokens"] == full > 64
    assert current["truncated"] == 1
    assert current["models"][MODEL] == {"requests": 1, "max_prompt_tokens": full, "truncated": 1,
                                        "refused_too_long": 0}


@pytest.mark.asyncio
async def test_a_prompt_too_long_sent_without_truncation_is_refused(stub_url: str) -> None:
    """As Ollama 0.12.6 on: `"truncate": false` turns the silent cut into a 400."""
    messages = [user("w" * 400), user("latest question")]
    async with ollama.AsyncClient(host=stub_url) as client:
        with pytest.raises(ollama.ResponseError) as refused:
            await client._request_raw("POST", "/api/chat", json={
                "model": MODEL, "messages": messages, "stream": False,
                "options": {"num_ctx": 64}, "truncate": False})
    assert refused.value.status_code == 400
    assert refused.value.error == "the input length exceeds the context length"
    current = stats(stub_url)
    assert (current["truncated"], current["refused_too_long"]) == (0, 1)
    fits = await chat(stub_url, [user("short")], options={"num_ctx": 64})
    assert fits.message.content == "Echo: short (turn 1)"


@pytest.mark.asyncio
async def test_default_num_ctx_applies_when_none_sent(stub_url: str) -> None:
    messages = [user("w" * 4200), {"role": "assistant", "content": "r" * 4200}, user("end")]
    full = count_prompt_tokens(messages, None, 4.0)
    assert full > 2048
    truncated = await chat(stub_url, messages)
    assert truncated.prompt_eval_count is not None and truncated.prompt_eval_count <= 2048
    roomy = await chat(stub_url, messages, options={"num_ctx": 8192})
    assert roomy.prompt_eval_count == full
    configure(stub_url, default_num_ctx=4096)
    live = await chat(stub_url, messages)
    assert live.prompt_eval_count == full
    assert stats(stub_url)["truncated"] == 1


# --------------------------------------------------------------------------- latency


@pytest.mark.asyncio
async def test_model_latency_delays_only_that_model(stub_url: str) -> None:
    configure(stub_url, model_latency={"slow": 250})
    started = time.monotonic()
    await chat(stub_url, [user("hi")], model="slow:latest")
    assert time.monotonic() - started >= 0.25
    started = time.monotonic()
    parts = await stream_parts(stub_url, [user("hi")], model="slow")
    assert time.monotonic() - started >= 0.25
    assert parts[-1].load_duration is not None and parts[-1].load_duration >= 250_000_000


@pytest.mark.asyncio
async def test_ms_per_token_delays_generation(stub_url: str) -> None:
    configure(stub_url, ms_per_token=20)
    started = time.monotonic()
    parts = await stream_parts(stub_url, [user("hi")])
    elapsed = time.monotonic() - started
    eval_count = parts[-1].eval_count
    assert eval_count is not None
    assert elapsed >= eval_count * 0.020
    assert parts[-1].eval_duration is not None
    assert parts[-1].eval_duration >= eval_count * 20_000_000 * 0.9


# --------------------------------------------------------------------------- quirks


@pytest.mark.asyncio
async def test_cache_count_quirk_counts_only_the_new_suffix(stub_url: str) -> None:
    configure(stub_url, quirks=["cache-count"])
    base = [{"role": "system", "content": "be helpful " * 10}, user("first question")]
    first = await chat(stub_url, base)
    assert first.prompt_eval_count == count_prompt_tokens(base, None, 4.0)

    extended = [*base, {"role": "assistant", "content": "ok"}, user("more")]
    second = await chat(stub_url, extended)
    suffix = count_prompt_tokens(extended[2:], None, 4.0)
    assert second.prompt_eval_count == suffix
    assert suffix < count_prompt_tokens(extended, None, 4.0)

    repeated = await stream_parts(stub_url, extended)
    assert repeated[-1].done is True
    assert repeated[-1].prompt_eval_count is None  # nothing new: the field is omitted

    unrelated = [user("something else entirely")]
    third = await chat(stub_url, unrelated)
    assert third.prompt_eval_count == count_prompt_tokens(unrelated, None, 4.0)

    # The cache is per model.
    elsewhere = await chat(stub_url, unrelated, model="other-model")
    assert elsewhere.prompt_eval_count == count_prompt_tokens(unrelated, None, 4.0)


@pytest.mark.asyncio
async def test_cache_count_reuses_the_longest_common_prefix(stub_url: str) -> None:
    """As Ollama's prefix cache: a prompt that shares only its leading messages
    with the previous request (a compaction rewrote what follows the system
    prompt, or another session sent the same system prompt) is charged only
    for what follows them."""
    configure(stub_url, quirks=["cache-count"])
    system = {"role": "system", "content": "be helpful " * 50}
    before = [system, user("first question"), {"role": "assistant", "content": "x" * 400}]
    await chat(stub_url, before)
    compacted = [system, {"role": "system", "content": "notes " * 20}, user("next")]
    after = await chat(stub_url, compacted)
    assert after.prompt_eval_count == count_prompt_tokens(compacted[1:], None, 4.0)
    assert after.prompt_eval_count < count_prompt_tokens(compacted, None, 4.0)


def test_dense_scripts_cost_more_tokens_than_ascii() -> None:
    assert count_prompt_tokens([user("a" * 400)], None, 4.0) == 100 + 4
    # CJK at 0.7 tokens a character, two-byte scripts at twice an ASCII one.
    assert count_prompt_tokens([user("中" * 400)], None, 4.0) == 280 + 4
    assert count_prompt_tokens([user("я" * 400)], None, 4.0) == 200 + 4
    assert count_prompt_tokens([user("a" * 200 + "中" * 200)], None, 4.0) == 50 + 140 + 4


@pytest.mark.asyncio
async def test_cache_count_needs_the_quirk(stub_url: str) -> None:
    base = [user("question")]
    await chat(stub_url, base)
    again = await chat(stub_url, base)
    assert again.prompt_eval_count == count_prompt_tokens(base, None, 4.0)


@pytest.mark.asyncio
async def test_empty_content_quirk_moves_text_to_thinking(stub_url: str) -> None:
    configure(stub_url, quirks=["empty-content"])
    response = await chat(stub_url, [user("hello")])
    assert response.message.content == ""
    assert response.message.thinking == "Echo: hello (turn 1)"
    parts = await stream_parts(stub_url, [user("hello")])
    assert joined_content(parts) == ""
    thinking = "".join(part.message.thinking or "" for part in parts)
    assert thinking == "Echo: hello (turn 1)"
    assert parts[-1].eval_count == math.ceil(len(thinking) / 4)


@pytest.mark.asyncio
async def test_error_quirk_answers_500(stub_url: str) -> None:
    configure(stub_url, quirks=["error"])
    with pytest.raises(ollama.ResponseError) as caught:
        await chat(stub_url, [user("hello")])
    assert caught.value.status_code == 500
    assert caught.value.error == "stub: simulated internal error"
    with pytest.raises(ollama.ResponseError) as streamed:
        await stream_parts(stub_url, [user("hello")])
    assert streamed.value.status_code == 500
    assert stats(stub_url)["requests"] == 2
    configure(stub_url, quirks=[])
    assert (await chat(stub_url, [user("hello")])).message.content == "Echo: hello (turn 1)"


@pytest.mark.asyncio
async def test_no_done_quirk_ends_the_answer_without_its_done_chunk(stub_url: str) -> None:
    configure(stub_url, quirks=["no-done"])
    parts = await stream_parts(stub_url, [user("hello")])
    assert joined_content(parts) == "Echo: hello (turn 1)"
    assert not any(part.done for part in parts)
    whole = await chat(stub_url, [user("hello")])
    assert whole.message.content == "Echo: hello (turn 1)"
    assert (whole.done, whole.done_reason, whole.prompt_eval_count) == (False, None, None)


@pytest.mark.asyncio
async def test_hang_quirk_times_out_without_blocking_the_server(stub_url: str) -> None:
    configure(stub_url, quirks=["hang"])
    async with (
        ollama.AsyncClient(host=stub_url, timeout=1) as client,
        httpx.AsyncClient(base_url=stub_url) as http,
    ):
        hanging = asyncio.ensure_future(client.chat(model=MODEL, messages=[user("hello")]))
        # While the request hangs, the server keeps answering other requests.
        await eventually(lambda: stats(stub_url)["requests"] == 1, "the request hanging")
        assert (await http.get("/api/version")).status_code == 200
        with pytest.raises(httpx.TimeoutException):
            await hanging
    assert stats(stub_url)["requests"] == 1
    configure(stub_url, quirks=[])
    assert (await chat(stub_url, [user("hello")])).message.content == "Echo: hello (turn 1)"


@pytest.mark.asyncio
async def test_a_held_model_answers_once_let_go_and_others_meanwhile(stub_url: str) -> None:
    configure(stub_url, held_models=["held-model"])
    async with ollama.AsyncClient(host=stub_url, timeout=30) as client:
        held = asyncio.ensure_future(client.chat(model="held-model:latest",
                                                 messages=[user("hello")]))
        await eventually(lambda: stats(stub_url)["requests"] == 1, "the held request arrived")
        other = await client.chat(model=MODEL, messages=[user("other")])
        assert other.message.content == "Echo: other (turn 1)"
        assert not held.done()
        configure(stub_url, held_models=[])
        assert (await held).message.content == "Echo: hello (turn 1)"


@pytest.mark.asyncio
async def test_a_paused_model_streams_its_first_piece_then_waits(stub_url: str) -> None:
    configure(stub_url, paused_models=[MODEL])
    async with ollama.AsyncClient(host=stub_url, timeout=30) as client:
        stream = await client.chat(model=MODEL, messages=[user("one two three")], stream=True)
        pieces = aiter(stream)
        first = await anext(pieces)
        assert first.message.content and not first.done
        second = asyncio.ensure_future(anext(pieces))
        # Not done while paused: the whole reply is asked for first, then the pause lifted.
        assert (await chat(stub_url, [user("one two three")])).message.content
        assert not second.done()
        configure(stub_url, paused_models=[])
        rest = [await second, *[part async for part in pieces]]
    assert first.message.content + joined_content(rest) == "Echo: one two three (turn 1)"
    assert rest[-1].done


# --------------------------------------------------------------------------- control endpoints


def test_config_endpoint_changes_and_validates(stub_url: str) -> None:
    effective = configure(
        stub_url,
        quirks=["cache-count", "empty-content"],
        ms_per_token=1.5,
        model_latency={"a": 10},
        chars_per_token=3,
    )
    assert effective["quirks"] == ["cache-count", "empty-content"]
    assert effective["ms_per_token"] == 1.5
    assert effective["model_latency"] == {"a": 10.0}
    assert effective["chars_per_token"] == 3.0
    assert control().get(f"{stub_url}/_stub/config").json() == effective

    bad_updates: list[Any] = [
        {"quirks": ["bogus"]},
        {"quirks": "error"},
        {"ms_per_token": -1},
        {"chars_per_token": 0},
        {"model_latency": {"a": "slow"}},
        {"default_num_ctx": 0},
        {"colour": "blue"},
        ["quirks"],
    ]
    for update in bad_updates:
        response = control().post(f"{stub_url}/_stub/config", json=update)
        assert response.status_code == 400, update
        assert response.json()["error"]
    # A rejected update must leave everything as it was, even its valid parts.
    response = control().post(f"{stub_url}/_stub/config", json={"ms_per_token": 9, "quirks": ["x"]})
    assert response.status_code == 400
    assert "x" in response.json()["error"]
    assert control().get(f"{stub_url}/_stub/config").json() == effective


@pytest.mark.asyncio
async def test_reset_zeroes_stats_and_forgets_cache(stub_url: str) -> None:
    configure(stub_url, quirks=["cache-count"])
    messages = [user("remember me")]
    await chat(stub_url, messages)
    async with ollama.AsyncClient(host=stub_url) as client:
        await client.list()  # not a chat request: not counted
    assert stats(stub_url)["requests"] == 1
    reset = control().post(f"{stub_url}/_stub/reset").json()
    assert reset == {"requests": 0, "max_prompt_tokens": 0, "truncated": 0, "models": {},
                     "streams_cut": 0, "refused_too_long": 0}
    after = await chat(stub_url, messages)
    assert after.prompt_eval_count == count_prompt_tokens(messages, None, 4.0)


@pytest.mark.asyncio
async def test_malformed_requests_get_400(stub_url: str) -> None:
    with pytest.raises(ollama.ResponseError) as bad_role:
        await chat(stub_url, [{"role": "robot", "content": "hi"}])
    assert bad_role.value.status_code == 400
    assert "messages[0].role" in bad_role.value.error

    cases: list[tuple[Any, str]] = [
        ({"messages": [user("hi")]}, "model"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": ["hi"]}, "messages[0]"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "content"),
        ({"model": MODEL, "messages": [user("hi")], "options": {"num_ctx": "big"}}, "num_ctx"),
        ({"model": MODEL, "messages": [user("hi")], "tools": "none"}, "tools"),
    ]
    async with httpx.AsyncClient(base_url=stub_url) as http:
        for body, fragment in cases:
            response = await http.post("/api/chat", json=body)
            assert response.status_code == 400, body
            assert fragment in response.json()["error"], body
        invalid = await http.post("/api/chat", content=b"{not json")
        assert invalid.status_code == 400
        assert "JSON" in invalid.json()["error"]


# --------------------------------------------------------------------------- summarisation


def summary_request(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    instruction = "COMPACTION SUMMARY: summarise the conversation below."
    return [{"role": "system", "content": instruction}, *conversation]


@pytest.mark.asyncio
async def test_summary_reply_structure_and_length(stub_url: str) -> None:
    goal = "Plan a three day trip to Lisbon with a focus on food " * 6  # > 200 characters
    conversation = [
        user(goal),
        {"role": "assistant", "content": "Day one: Alfama and pastéis. " * 80},
        user("And day two?"),
        {"role": "assistant", "content": "Day two: Belém and the river. " * 80},
    ]
    response = await chat(stub_url, summary_request(conversation))
    summary = response.message.content
    assert summary is not None
    lines = summary.split("\n")
    assert [line.split(": ", 1)[0] for line in lines] == ["Goal", "Progress", "Next step"]
    assert lines[0] == "Goal: " + goal[:200]
    total = sum(len(str(m["content"])) for m in conversation)
    assert len(summary) == round(total * 0.1)
    again = await chat(stub_url, summary_request(conversation))
    assert again.message.content == summary
    changed = await chat(stub_url, summary_request([*conversation, user("one more thing")]))
    assert changed.message.content != summary


@pytest.mark.asyncio
async def test_summary_length_bounds_and_exact_override(stub_url: str) -> None:
    tiny = await chat(stub_url, summary_request([user("hi")]))
    assert tiny.message.content is not None and len(tiny.message.content) == 80
    huge = await chat(
        stub_url,
        summary_request([user("x " * 30000), {"role": "assistant", "content": "y " * 30000}]),
        options={"num_ctx": 100_000},
    )
    assert huge.message.content is not None and len(huge.message.content) == 4000

    conversation = summary_request([user("goal text"), {"role": "assistant", "content": "done"}])
    for wanted in (0, 10, 500):
        exact = await chat(stub_url, conversation, options={"stub_summary_chars": wanted})
        assert exact.message.content is not None
        assert len(exact.message.content) == wanted
    empty = await chat(stub_url, conversation, options={"stub_summary_chars": 0})
    assert empty.message.content == ""
    assert empty.eval_count == 1


@pytest.mark.asyncio
async def test_summary_goal_from_rendered_transcript_and_marker_case(stub_url: str) -> None:
    transcript = "user: fix the login bug\nassistant: looking at auth.py\nuser: thanks"
    response = await chat(stub_url, summary_request([user(transcript)]))
    assert response.message.content is not None
    assert response.message.content.startswith("Goal: fix the login bug\n")

    rendered = (
        "EARLIER NOTES:\nnone\n\nTRANSCRIPT TO CONDENSE:\n[user]\nrename the user table\n"
        "in db.py\n\n[assistant]\ndone\n\n[user]\nnow migrate"
    )
    blocks = await chat(
        stub_url, summary_request([user(rendered)]), options={"stub_summary_chars": 400}
    )
    assert blocks.message.content is not None
    assert blocks.message.content.startswith("Goal: rename the user table in db.py\n")

    lowercase = [{"role": "system", "content": "compaction summary"}, user("hello")]
    assert (await chat(stub_url, lowercase)).message.content == "Echo: hello (turn 1)"


# --------------------------------------------------------------------------- in-process and CLI


@pytest.mark.asyncio
async def test_build_app_serves_in_process() -> None:
    app = build_app(StubConfig(chars_per_token=2.0, quirks={"empty-content"}))
    transport = httpx.ASGITransport(app=app)
    async with ollama.AsyncClient(host="http://stub.invalid", transport=transport) as client:
        response = await client.chat(model="m", messages=[user("inside")])
        stream = await client.chat(model="m", messages=[user("x")], stream=True)
        parts = [part async for part in stream]
    assert response.message.content == ""
    assert response.message.thinking == "Echo: inside (turn 1)"
    assert response.prompt_eval_count == count_prompt_tokens([user("inside")], None, 2.0)
    assert parts[-1].done is True


@pytest.mark.asyncio
async def test_cli_flags_configure_the_stub() -> None:
    flags = (
        "--chars-per-token", "2", "--default-num-ctx", "100", "--ms-per-token", "0.5",
        "--model-latency", "slow=5", "--model-latency", "other:7b=1",
        "--quirk", "empty-content", "--quirk", "cache-count",
    )  # fmt: skip
    with running_stub(*flags) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            config = (await http.get("/_stub/config")).json()
        assert config == {
            "quirks": ["cache-count", "empty-content"],
            "ms_per_token": 0.5,
            "model_latency": {"slow": 5.0, "other:7b": 1.0},
            "chars_per_token": 2.0,
            "default_num_ctx": 100,
            "held_models": [],
            "paused_models": [],
        }
        response = await chat(url, [user("z" * 400)])
        assert response.message.content == ""
        assert response.prompt_eval_count == 100  # clamped to --default-num-ctx


def test_script_prints_url_and_shuts_down_promptly_while_hanging() -> None:
    command = [sys.executable, "-m", "scripts.ollama_stub", "--port", "0", "--quirk", "hang"]
    with subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            match = re.fullmatch(r"ollama stand-in listening on (http://127\.0\.0\.1:\d+)", line)
            assert match, line
            url = match.group(1)
            assert httpx.get(f"{url}/api/version").json() == {"version": "0.0.0-stub"}
            _stop_while_a_request_hangs(process, url)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _stop_while_a_request_hangs(process: subprocess.Popen[str], url: str) -> None:
    outcome: list[BaseException] = []

    def hanging_request() -> None:
        try:
            with ollama.Client(host=url, timeout=10) as client:
                client.chat(model=MODEL, messages=[user("x")])
        except BaseException as exc:  # the outcome is checked by the test thread
            outcome.append(exc)

    requester = threading.Thread(target=hanging_request, daemon=True)
    requester.start()
    until(lambda: stats(url)["requests"] >= 1, "the request reached the stand-in")
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=5)
    requester.join(timeout=5)
    # The hanging request is released by the exit itself, so it is answered
    # (503, "hang ended"), rather than cut unanswered by uvicorn's backstop.
    assert len(outcome) == 1
    assert isinstance(outcome[0], ollama.ResponseError), repr(outcome[0])
    assert outcome[0].status_code == 503 and "hang ended" in outcome[0].error


@pytest.mark.asyncio
async def test_toolloop_keeps_calling_after_each_result(stub_url: str) -> None:
    client = ollama.AsyncClient(host=stub_url)
    tools = [{"type": "function", "function": {"name": "calc", "description": "c",
                                               "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "!toolloop !tool calc {\"x\": 1}"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"function": {"name": "calc", "arguments": {"x": 1}}}]},
                {"role": "tool", "content": "1", "tool_name": "calc"}]
    again = await client.chat(model="stub-model", messages=messages, tools=tools, stream=False)
    assert [c.function.name for c in again.message.tool_calls or []] == ["calc"]
    messages[0]["content"] = "!tool calc {}"
    done = await client.chat(model="stub-model", messages=messages, tools=tools, stream=False)
    assert done.message.content == "tool results: 1"


@pytest.mark.asyncio
async def test_summary_goal_carries_the_quoted_first_request(stub_url: str) -> None:
    client = ollama.AsyncClient(host=stub_url)
    system = {"role": "system", "content": "Write the COMPACTION SUMMARY."}
    first = {"role": "user", "content": "FIRST REQUEST (quote it):\nbuild a parser\n\n"
                                        "TRANSCRIPT:\n[user] later question"}
    merged = {"role": "user", "content": "EARLIER NOTES (merge):\nGoal: build a parser\n"
                                         "Progress: x\n\nTRANSCRIPT:\n[user] newer"}
    for message in (first, merged):
        reply = await client.chat(model="stub-model", messages=[system, message], stream=False)
        assert reply.message.content.startswith("Goal: build a parser")


@pytest.mark.asyncio
async def test_num_predict_cuts_the_answer_and_says_length(stub_url: str) -> None:
    """As Ollama: an answer longer than num_predict tokens stops there, with
    done_reason "length"; a shorter one, or -1 (no limit), stops as usual."""
    conversation = summary_request([user("goal text !summary 2000"),
                                    {"role": "assistant", "content": "done"}])
    whole = await chat(stub_url, conversation)
    assert whole.done_reason == "stop" and len(whole.message.content or "") == 2000
    cut = await chat(stub_url, conversation, options={"num_predict": 100})
    assert cut.done_reason == "length" and cut.eval_count == 100
    assert whole.message.content is not None
    assert cut.message.content == whole.message.content[:400]  # 4 characters per token
    parts = await stream_parts(stub_url, conversation, options={"num_predict": 100})
    assert parts[-1].done_reason == "length" and joined_content(parts) == cut.message.content
    for roomy in (600, -1):
        answer = await chat(stub_url, conversation, options={"num_predict": roomy})
        assert answer.done_reason == "stop" and answer.message.content == whole.message.content
    echo = await chat(stub_url, [user("hello !long 1000")], options={"num_predict": 10})
    assert echo.done_reason == "length" and len(echo.message.content or "") == 40
