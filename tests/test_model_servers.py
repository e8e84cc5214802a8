"""The product on real processes against a model server with the models people
have: one without tools, one not pulled, a thinking model, one whose own window
is smaller than NUM_CTX."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from schemas import subjects
from services.core.tokens import prompt_budget
from tests.events import watching
from tests.stub_server import running_stub
from tests.system import System

NUM_CTX = 8192
SMALL_WINDOW = 4096
STUB_FLAGS = (
    "--models", "stub-model,plain,thinker,small",
    "--capabilities", "plain=completion",
    "--capabilities", "thinker=completion,tools,thinking",
    "--context-length", f"small={SMALL_WINDOW}",
)  # fmt: skip


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with running_stub(*STUB_FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def system(nats_url: str, stub: str) -> Iterator[System]:
    # The tools service runs, so every turn has tools to offer.
    running = System(nats_url, stub, {"NUM_CTX": str(NUM_CTX), "COMPACTION_THRESHOLD": "0",
                                      "COMPACTION_TAIL_TURNS": "1"},
                     services=("tools", "generator", "decider", "gateway"))
    try:
        yield running.start()
    finally:
        running.stop()


@pytest.fixture
async def http(system: System) -> AsyncIterator[httpx.AsyncClient]:
    async with system.http(timeout=60) as client:
        yield client


async def create(http: httpx.AsyncClient, model: str) -> str:
    response = await http.post("/api/sessions", json={"model": model})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


async def ask(http: httpx.AsyncClient, sid: str, content: str) -> httpx.Response:
    return await http.post(f"/api/sessions/{sid}/messages", json={"content": content})


async def session(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    return dict((await http.get(f"/api/sessions/{sid}")).json())


async def test_a_model_without_tools_holds_a_conversation(http: httpx.AsyncClient) -> None:
    sid = await create(http, "plain")
    replies = [await ask(http, sid, text) for text in ("hello", "!tool current_time", "bye")]
    assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
    assert [r.json()["reply"] for r in replies] == [
        "Echo: hello (turn 1)", "Echo: !tool current_time (turn 2)", "Echo: bye (turn 3)"]
    # The same system offers tools to a model that has them.
    tooled = await create(http, "stub-model")
    called = await ask(http, tooled, "!tool current_time")
    assert called.status_code == 200 and called.json()["reply"].startswith("tool results: ")


async def test_a_missing_model_fails_with_the_pull_command(http: httpx.AsyncClient) -> None:
    sid = await create(http, "absent:7b")
    answer = await ask(http, sid, "hello")
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == "model_not_found"
    assert "absent:7b" in error["message"] and "ollama pull absent:7b" in error["message"]
    # Streamed, the error comes where the answer would be.
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": "again"},
                           headers={"Accept": "text/event-stream"}) as stream:
        body = "".join([chunk async for chunk in stream.aiter_text()])
    assert "event: error" in body and "model_not_found" in body
    assert (await session(http, sid))["messages"] == []


async def test_a_thinking_models_summary_is_not_empty(
        nats_url: str, http: httpx.AsyncClient) -> None:
    sid = await create(http, "thinker")
    for text in ("Please plan a trip to Lisbon.", "three days", "by train", "cheap hotels"):
        answer = await ask(http, sid, f"{text} !long 400")
        assert answer.status_code == 200, answer.text
        # Its thinking comes apart from the answer.
        assert answer.json()["thinking"] and answer.json()["reply"].startswith("Echo: ")
    async with watching(nats_url, subjects.COMPACTION_RESULT) as watcher:
        assert (await http.post(f"/api/sessions/{sid}/compact")).status_code == 202
        await watcher.wait_for(lambda p: p["session_id"] == sid, 30)
    result = next(p for p in watcher.payloads("compaction.result") if p["session_id"] == sid)
    assert result["status"] == "completed" and result["method"] == "summary", result
    assert result["summary"].startswith("Goal: Please plan a trip to Lisbon.")
    # The answers' thinking is not kept as context.
    stored = (await session(http, sid))["messages"]
    assert stored and not any("thinking" in message for message in stored)


async def test_num_ctx_above_the_models_window_is_capped(http: httpx.AsyncClient) -> None:
    sid = await create(http, "small")
    assert (await ask(http, sid, "hello")).status_code == 200
    shown = await session(http, sid)
    assert shown["num_ctx"] == SMALL_WINDOW
    assert shown["budget"] == prompt_budget(SMALL_WINDOW)
    # A message that fits NUM_CTX but not the model's window is refused, not cut
    # silently by the model server.
    too_long = await ask(http, sid, "word " * 4000)
    assert too_long.status_code == 413, too_long.text
    assert f"num_ctx {SMALL_WINDOW}" in too_long.json()["error"]["message"]
    # A model with a larger window keeps NUM_CTX.
    other = await create(http, "plain")
    assert (await ask(http, other, "hello")).status_code == 200
    assert (await session(http, other))["num_ctx"] == NUM_CTX
