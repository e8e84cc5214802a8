"""Compaction on real processes: manual and automatic, background and
blocking, what is kept, what is reported, and that no prompt ever overflows.

The window is small (NUM_CTX 2048, budget 1792 tokens) so a few turns of
`!long` answers fill it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import ToolOutcome
from services.shared.bus import Bus
from tests.events import Watcher, consumer_caught_up, watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, running_stub
from tests.system import System

NUM_CTX = 2048
SMALL_WINDOW = {"NUM_CTX": str(NUM_CTX), "COMPACTION_TAIL_TURNS": "2",
                "COMPACTION_COOLDOWN_S": "1"}
EVENTS = (subjects.COMPACTION_REQUEST, subjects.COMPACTION_EVENT, subjects.COMPACTION_RESULT,
          f"{subjects.STATE_PREFIX}.*")
SYSTEM_PROMPT = "You are a careful assistant. Answer briefly."


@pytest.fixture
def stub() -> Iterator[str]:
    with running_stub("--model-latency", "summariser=1500") as url:
        yield url


@pytest.fixture
async def start(private_nats: NatsServer, stub: str
                ) -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    """Start the system with settings of the test's own and hand back an HTTP
    client on it; everything is stopped after, even when the test fails."""
    systems: list[System] = []
    clients: list[httpx.AsyncClient] = []

    def starter(**env: str) -> httpx.AsyncClient:
        systems.append(System(private_nats.url, stub, {**SMALL_WINDOW, **env},
                              services=("generator", "decider", "gateway")).start())
        clients.append(httpx.AsyncClient(base_url=systems[-1].base_url, timeout=60))
        return clients[-1]

    yield starter
    for client in clients:
        await client.aclose()
    for system in systems:
        system.stop()


async def create(http: httpx.AsyncClient, **body: object) -> str:
    response = await http.post("/api/sessions", json={"system": SYSTEM_PROMPT, **body})
    return str(response.json()["session_id"])


async def chat(http: httpx.AsyncClient, sid: str, turns: int, filler: int = 300,
               start: int = 1) -> list[httpx.Response]:
    return [await http.post(f"/api/sessions/{sid}/messages",
                            json={"content": f"question {i} !long {filler}"})
            for i in range(start, start + turns)]


async def session(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    return dict((await http.get(f"/api/sessions/{sid}")).json())


async def stub_stats(stub: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        return dict((await client.get(f"{stub}/_stub/stats")).json())


def results(watcher: Watcher, sid: str) -> list[dict[str, Any]]:
    return [p for p in watcher.payloads("compaction.result") if p["session_id"] == sid]


async def next_result(watcher: Watcher, sid: str, count: int = 1) -> dict[str, Any]:
    await watcher.wait_until(lambda: len(results(watcher, sid)) >= count, 20)
    return results(watcher, sid)[count - 1]


async def test_manual_compaction_keeps_the_tail_and_stacks_summaries(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start(COMPACTION_THRESHOLD="0")
    sid = await create(http)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "Please build a parser."})
    await chat(http, sid, 4, filler=100)
    before = await session(http, sid)
    async with watching(private_nats.url, *EVENTS) as watcher:
        accepted = await http.post(f"/api/sessions/{sid}/compact",
                                   json={"instructions": "keep the parser details"})
        assert accepted.status_code == 202
        assert accepted.json() == {"status": "compaction_requested"}
        first = await next_result(watcher, sid)
    request = watcher.payloads("compaction.request")[0]
    assert request["auto"] is False and request["instructions"] == "keep the parser details"
    started = watcher.payloads("compaction.event")[0]
    assert started["event"] == "started" and started["session_id"] == sid
    assert first["status"] == "completed" and first["error"] is None
    assert first["tokens_after"] < first["tokens_before"]
    assert first["summary"].startswith("Goal: Please build a parser.")

    after = await session(http, sid)
    assert after["system"] == SYSTEM_PROMPT
    assert after["compactions"] == 1
    assert after["summary"] == first["summary"]
    assert after["messages"] == before["messages"][-4:]  # the last two turns, raw
    assert after["token_count"] < before["token_count"]
    states = [p["to_state"] for p in watcher.payloads("generator.state")]
    assert "compacting" in states and states[-1] == "idle"

    await chat(http, sid, 3, filler=100, start=10)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        second = await next_result(watcher, sid)
    assert second["status"] == "completed"
    assert second["summary"].startswith("Goal: Please build a parser.")
    assert (await session(http, sid))["compactions"] == 2


async def test_compaction_with_nothing_to_compact_says_why(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start()
    empty, short = await create(http), await create(http)
    await chat(http, short, 2)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{empty}/compact")
        await http.post(f"/api/sessions/{short}/compact")
        none = await next_result(watcher, empty)
        little = await next_result(watcher, short)
    assert (none["status"], none["error"]) == ("skipped", "no history to compact")
    assert little["status"] == "skipped"
    assert little["error"].startswith("nothing to compact")
    assert (await http.post("/api/sessions/nosuchsession/compact")).status_code == 404


async def test_the_session_keeps_answering_while_its_summary_is_written(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start(COMPACTION_MODEL="summariser", COMPACTION_THRESHOLD="0")
    sid = await create(http)
    await chat(http, sid, 5, filler=100)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        await watcher.wait_for(lambda e: e.get("message_type") == "compaction.event")
        assert (await session(http, sid))["state"] == "compacting"
        during = await chat(http, sid, 3, filler=10, start=20)
        answered_while_compacting = not results(watcher, sid)
        result = await next_result(watcher, sid)
    assert answered_while_compacting
    assert all(r.status_code == 200 for r in during)
    assert result["status"] == "completed", result
    kept = [m["content"] for m in (await session(http, sid))["messages"] if m["role"] == "user"]
    # The two tail turns plus every turn answered during the compaction.
    assert kept == ["question 4 !long 100", "question 5 !long 100", "question 20 !long 10",
                    "question 21 !long 10", "question 22 !long 10"]


async def test_blocking_mode_refuses_queries_during_a_compaction(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start(COMPACTION_MODEL="summariser", COMPACTION_THRESHOLD="0",
                   COMPACTION_MODE="blocking", BLOCKING_QUERY_WAIT_S="0")
    sid = await create(http)
    await chat(http, sid, 5, filler=100)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        await watcher.wait_for(lambda e: e.get("message_type") == "compaction.event")
        refused = await http.post(f"/api/sessions/{sid}/messages", json={"content": "now?"})
        result = await next_result(watcher, sid)
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "compacting"
    assert result["status"] == "completed"
    moves = [(p["from_state"], p["to_state"]) for p in watcher.payloads("generator.state")]
    assert moves == [("idle", "compacting"), ("compacting", "idle")]
    after = await http.post(f"/api/sessions/{sid}/messages", json={"content": "now?"})
    assert after.status_code == 200


@pytest.mark.parametrize("quirk, error", [
    ("error", "summariser failed: Ollama answered HTTP 500"),
    ("empty-content", "summariser failed: it returned an empty summary"),
])
async def test_a_failed_summary_is_never_spliced(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient], quirk: str,
    error: str
) -> None:
    http = start(COMPACTION_THRESHOLD="0")
    sid = await create(http)
    await chat(http, sid, 4, filler=50)
    before = await session(http, sid)
    await configure_stub(stub, quirks=[quirk])
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        result = await next_result(watcher, sid)
    await configure_stub(stub, quirks=[])
    assert result["status"] == "failed"
    assert result["error"].startswith(error)
    after = await session(http, sid)
    assert after["messages"] == before["messages"] and after["compactions"] == 0
    assert after["state"] == "idle"


async def test_the_decider_compacts_in_time_and_nothing_ever_overflows(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start()
    sid = await create(http)
    async with watching(private_nats.url, *EVENTS) as watcher:
        replies = await chat(http, sid, 30)
        await next_result(watcher, sid)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    requests = [p for p in watcher.payloads("compaction.request") if p["auto"]]
    assert requests, "the decider never fired"
    senders = {e["sender_id"] for e in watcher.events
               if e.get("message_type") == "compaction.request"}
    assert senders == {"compaction-decider"}
    assert {r["level"] for r in requests} <= {"gentle", "tighter", "emergency"}
    assert all("threshold" in r["reason"] for r in requests)
    # A background compaction overtaken by an emergency one inside a turn is
    # skipped as superseded; none may fail.
    statuses = [r["status"] for r in results(watcher, sid)]
    assert "completed" in statuses and set(statuses) <= {"completed", "skipped"}, statuses
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX
    assert stats["truncated"] == 0
    assert (await session(http, sid))["compactions"] >= 1


@pytest.mark.parametrize("env, body", [
    ({"COMPACTION_THRESHOLD": "0"}, {}),
    ({}, {"auto_compact": False}),
])
async def test_without_automatic_compaction_an_oversized_prompt_is_refused(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient],
    env: dict[str, str], body: dict[str, object]
) -> None:
    http = start(**env)
    sid = await create(http, **body)
    async with watching(private_nats.url, *EVENTS) as watcher:
        replies = await chat(http, sid, 12, filler=600)
        # The decider has judged every report.
        await consumer_caught_up(private_nats.url, subjects.GENERATIONS_STREAM,
                                 "compaction-decider")
    refused = [r for r in replies if r.status_code != 200]
    assert refused, "the window never filled"
    assert refused[0].status_code == 413
    assert refused[0].json()["error"]["code"] == "context_overflow"
    assert "compact" in refused[0].json()["error"]["message"]
    assert not watcher.payloads("compaction.request")
    assert not watcher.payloads("compaction.event")
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX and stats["truncated"] == 0
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        assert (await next_result(watcher, sid))["status"] == "completed"
    assert (await chat(http, sid, 1, filler=10, start=50))[0].status_code == 200


async def test_a_message_larger_than_the_window_is_refused_before_sending(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start()
    sid = await create(http)
    await chat(http, sid, 2)
    sent_before = (await stub_stats(stub))["requests"]
    huge = await http.post(f"/api/sessions/{sid}/messages", json={"content": "x" * 20_000})
    assert huge.status_code == 413
    assert huge.json()["error"]["code"] == "context_overflow"
    stats = await stub_stats(stub)
    # No model call with the huge message; at most the emergency summariser ran.
    assert stats["max_prompt_tokens"] <= NUM_CTX
    assert stats["requests"] - sent_before <= 1
    assert all(m["content"] != "x" * 20_000 for m in (await session(http, sid))["messages"])


async def serve_a_verbose_tool(nats_url: str) -> Any:
    """A tool of the test's own on real NATS whose output is long."""
    nc = await nats.connect(nats_url)
    definition = [{"type": "function", "function": {
        "name": "dump", "description": "prints a lot", "parameters": {"type": "object"}}}]

    async def listing(msg: Msg) -> None:
        await msg.respond(json.dumps(definition).encode())

    async def dump(msg: Msg) -> None:
        await msg.respond(Bus(nc, "tools").envelope(
            msg.subject, ToolOutcome(name="dump", content="line of output\n" * 150)
        ).model_dump_json().encode())

    await nc.subscribe(subjects.TOOL_LIST, cb=listing)
    await nc.subscribe(subjects.tool("dump"), cb=dump)
    return nc


async def test_without_a_summary_old_tool_output_is_elided_instead(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    tools = await serve_a_verbose_tool(private_nats.url)
    http = start(COMPACTION_THRESHOLD="0", NUM_CTX="8192")
    sid = await create(http)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "!tool dump"})
    await chat(http, sid, 3, filler=10)
    before = await session(http, sid)
    await configure_stub(stub, quirks=["empty-content"])
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        result = await next_result(watcher, sid)
    await configure_stub(stub, quirks=[])
    await tools.drain()
    assert (result["status"], result["method"]) == ("completed", "elision"), result
    assert result["note"].startswith("summariser failed: it returned an empty summary")
    assert result["tokens_after"] < result["tokens_before"]
    after = await session(http, sid)
    assert len(after["messages"]) == len(before["messages"])
    tool_output = after["messages"][2]
    assert tool_output["role"] == "tool" and "elided" in tool_output["content"]
    assert len(tool_output["content"]) < len(before["messages"][2]["content"])


async def test_a_summary_that_takes_too_long_is_abandoned(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start(COMPACTION_THRESHOLD="0", COMPACTION_MODEL="summariser",
                   SUMMARY_TIMEOUT_S="0.5")
    sid = await create(http)
    await chat(http, sid, 4, filler=50)
    before = await session(http, sid)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        result = await next_result(watcher, sid)
    assert result["status"] == "failed"
    assert result["error"].startswith("summariser failed: no summary within 0.5 s")
    assert (await session(http, sid))["messages"] == before["messages"]


async def test_after_a_compaction_a_count_without_the_cached_system_prompt_is_not_the_whole(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """The first call after a compaction shares only the pinned system prompt
    with the call before it, and a prefix cache (the stand-in's cache-count
    quirk, the summariser being another model) counts only the rest. Taken for
    the whole prompt, that count halved the ratio and the next, oversized
    prompt was estimated to fit and sent."""
    await configure_stub(stub, quirks=["cache-count"])
    http = start(COMPACTION_MODEL="summariser")
    sid = await create(http, system="You are terse. " * 187, auto_compact=False)  # 700 tokens
    for i in range(3):
        assert (await http.post(f"/api/sessions/{sid}/messages",
                                json={"content": f"question {i} " + "q" * 400})).status_code == 200
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        assert (await next_result(watcher, sid))["status"] == "completed"
    # Counted without the 700 cached tokens of the system prompt.
    first = await http.post(f"/api/sessions/{sid}/messages", json={"content": "p" * 2000})
    assert first.status_code == 200
    assert first.json()["prompt_tokens"] < NUM_CTX // 2
    # About 1,900 tokens in a budget of 1,792: it must not be sent.
    oversized = await http.post(f"/api/sessions/{sid}/messages", json={"content": "r" * 1400})
    assert oversized.status_code == 413, oversized.text
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX - 256
