"""The stand-in's models, as Ollama has them: pulled or not, with or without
tools and thinking, each with its own window, loaded on the first call, and
serving only so many requests at once. Driven through the real ``ollama`` client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from tests.stub_server import configure_stub, running_stub

LOAD_MS = 300
FLAGS = (
    "--models", "plain,thinker,small,tooled",
    "--capabilities", "plain=completion",
    "--capabilities", "thinker=completion,tools,thinking",
    "--context-length", "small=4096",
    "--parallel", "1",
    "--load-ms", str(LOAD_MS),
)  # fmt: skip
TOOL = {"type": "function", "function": {"name": "echo", "description": "Echo.",
                                         "parameters": {"type": "object", "properties": {}}}}
SUMMARY_REQUEST = [
    {"role": "system", "content": "Write a COMPACTION SUMMARY of the conversation."},
    {"role": "user", "content": "[user]: plan a trip to Lisbon\n[assistant]: sure"},
]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running_stub(*FLAGS) as base:
        yield base


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def chat(url: str, model: str, messages: list[dict[str, Any]],
               **kwargs: Any) -> ollama.ChatResponse:
    async with ollama.AsyncClient(host=url) as client:
        response: ollama.ChatResponse = await client.chat(model=model, messages=messages,
                                                          **kwargs)
    return response


async def test_a_model_not_there_answers_404_as_ollama_does(url: str) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        await chat(url, "absent", user("hi"))
    assert raised.value.status_code == 404
    assert raised.value.error == 'model "absent" not found, try pulling it first'
    async with ollama.AsyncClient(host=url) as client:
        with pytest.raises(ollama.ResponseError) as shown:
            await client.show("absent")
    assert shown.value.status_code == 404


async def test_tags_list_the_models_that_are_there(url: str) -> None:
    async with ollama.AsyncClient(host=url) as client:
        names = {model.model for model in (await client.list()).models}
    assert {"plain:latest", "thinker:latest", "small:latest", "tooled:latest"} <= names
    assert "stub-model:latest" not in names


async def test_tools_offered_to_a_model_without_them_get_400(url: str) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        await chat(url, "plain", user("hi"), tools=[TOOL])
    assert raised.value.status_code == 400
    assert raised.value.error == "plain does not support tools"
    assert (await chat(url, "plain", user("hi"))).message.content.startswith("Echo: hi")
    assert (await chat(url, "tooled", user("hi"), tools=[TOOL])).message.content


async def test_show_reports_capabilities_and_window(url: str) -> None:
    async with ollama.AsyncClient(host=url) as client:
        plain, thinker, small = [await client.show(m) for m in ("plain", "thinker", "small")]
    assert plain.capabilities == ["completion"]
    assert thinker.capabilities == ["completion", "tools", "thinking"]
    assert small.capabilities == ["completion", "tools"]
    assert small.modelinfo is not None and small.modelinfo["stub.context_length"] == 4096
    assert plain.modelinfo is not None and plain.modelinfo["stub.context_length"] == 131072
    assert plain.parameters and "num_ctx" in plain.parameters


async def test_a_window_asked_beyond_the_models_own_is_cut_to_it(url: str) -> None:
    """As Ollama's scheduler does: `small` (4,096) asked for 8,192 runs with
    4,096, so a prompt of about 5,000 tokens sent untruncated is refused."""
    body = {"model": "small", "messages": user("w " * 10_000), "stream": False,
            "options": {"num_ctx": 8192}, "truncate": False}
    async with ollama.AsyncClient(host=url) as client:
        with pytest.raises(ollama.ResponseError) as refused:
            await client._request_raw("POST", "/api/chat", json=body)
        assert refused.value.status_code == 400
        answered = await client._request_raw("POST", "/api/chat",
                                             json={**body, "model": "plain"})
    assert answered.json()["message"]["content"].startswith("Echo: w w")


async def test_a_thinking_model_thinks_unless_told_not_to(url: str) -> None:
    thought = await chat(url, "thinker", user("hi"))
    assert thought.message.thinking and thought.message.content.startswith("Echo: hi")
    plain = await chat(url, "thinker", user("hi"), think=False)
    assert not plain.message.thinking and plain.message.content.startswith("Echo: hi")
    assert not (await chat(url, "plain", user("hi"))).message.thinking
    with pytest.raises(ollama.ResponseError) as raised:
        await chat(url, "plain", user("hi"), think=True)
    assert raised.value.status_code == 400
    assert raised.value.error == '"plain" does not support thinking'


async def test_a_thinking_model_can_spend_a_summary_on_thinking(url: str) -> None:
    thought = await chat(url, "thinker", SUMMARY_REQUEST)
    assert thought.message.content == "" and thought.message.thinking
    told = await chat(url, "thinker", SUMMARY_REQUEST, think=False)
    assert told.message.content.startswith("Goal: ") and not told.message.thinking
    async with ollama.AsyncClient(host=url) as client:
        parts = [part async for part in await client.chat(
            model="thinker", messages=SUMMARY_REQUEST, stream=True)]
    assert "".join(p.message.content or "" for p in parts) == ""
    assert "".join(p.message.thinking or "" for p in parts)


async def test_the_first_call_to_a_model_loads_it(url: str) -> None:
    first, second = [await chat(url, "small", user("hi")) for _ in range(2)]
    assert first.load_duration is not None and first.load_duration >= LOAD_MS * 1_000_000
    assert second.load_duration is not None and second.load_duration < LOAD_MS * 1_000_000


async def slots(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as http:
        answer: dict[str, Any] = (await http.get("/_stub/slots")).json()
    return answer


async def until(url: str, check: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = await slots(url)
        if check(state):
            return state
        await asyncio.sleep(0.02)
    raise AssertionError(f"the stand-in's slots never got there: {await slots(url)}")


async def test_with_one_slot_a_second_request_waits_for_the_first(url: str) -> None:
    await chat(url, "tooled", user("load it"))
    await configure_stub(url, ms_per_token=50)
    try:
        async with ollama.AsyncClient(host=url) as holder:
            stream = await holder.chat(model="tooled", messages=user("!long 4000"), stream=True)
            assert (await anext(aiter(stream))).message.content
            second = asyncio.create_task(chat(url, "tooled", user("next")))
            await until(url, lambda s: s["waiting"].get("tooled:latest") == 1)
            assert not second.done()
            # Another model has slots of its own.
            assert (await chat(url, "plain", user("elsewhere"))).message.content
        # Leaving the first stream frees its slot, and the waiting one goes ahead.
        await configure_stub(url, ms_per_token=0)
        assert (await second).message.content.startswith("Echo: next")
    finally:
        await configure_stub(url, ms_per_token=0)
    await until(url, lambda s: s["in_progress"].get("tooled:latest") == 0)


async def test_pull_streams_progress_and_then_the_model_is_there(url: str) -> None:
    async with ollama.AsyncClient(host=url) as client:
        progress = [part async for part in await client.pull("newcomer", stream=True)]
        names = {model.model for model in (await client.list()).models}
    statuses = [part.status for part in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    layer = [part for part in progress if part.total]
    assert layer and layer[-1].completed == layer[-1].total
    assert [p.completed for p in layer] == sorted(p.completed or 0 for p in layer)
    assert "newcomer:latest" in names
    assert (await chat(url, "newcomer", user("hi"))).message.content.startswith("Echo: hi")


async def test_without_the_flag_any_model_is_served() -> None:
    with running_stub() as base:
        assert (await chat(base, "whatever", user("hi"))).message.content
        async with ollama.AsyncClient(host=base) as client:
            assert (await client.show("whatever")).capabilities == ["completion", "tools"]
