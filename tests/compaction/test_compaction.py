"""Compaction on real processes: manual and automatic, background and
blocking, what is kept, what is reported, and what a compaction sends the
summariser (`conftest.py` here starts the system they run on)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from schemas import subjects
from tests.compaction.rig import (
    EVENTS,
    NUM_CTX,
    SMALL_WINDOW,
    SMALL_WRITER_WINDOW,
    SYSTEM_PROMPT,
    chat,
    create,
    next_result,
    publish_request,
    results,
    serve_a_verbose_tool,
    session,
)
from tests.events import Watcher, decider_caught_up, watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, stub_stats
from tests.system import System


async def test_one_count_of_the_tokens_in_the_context(
    private_nats: NatsServer, start: Callable[..., httpx.AsyncClient]
) -> None:
    """A compaction's before and after, the session's token_count (the page's gauge)
    and the decider's estimate are one number: the next prompt, offered tools included."""
    http = start(services=("tools", "generator", "decider", "gateway"),
                 COMPACTION_THRESHOLD="0.6", COMPACTION_MIN_RELIEF="0.05")
    manual = await create(http, auto_compact=False)  # the decider leaves it alone
    await chat(http, manual, 4, filler=200)
    before = await session(http, manual)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{manual}/compact")
        result = await next_result(watcher, manual)
    after = await session(http, manual)
    assert result["status"] == "completed", result
    assert (result["tokens_before"], result["tokens_after"]) == (
        before["token_count"], after["token_count"])
    assert watcher.payloads("compaction.event")[0]["tokens_before"] == before["token_count"]

    auto = await create(http)
    async with watching(private_nats.url, subjects.RESPONSE_GENERATION, *EVENTS) as watcher:
        requested = await turns_until_the_decider_fires(private_nats.url, http, watcher, auto)
        result = await next_result(watcher, auto)
    estimate = int(requested["reason"].split()[1])  # "estimate N of budget ..."
    assert result["status"] == "completed", result
    assert result["tokens_before"] == estimate
    assert watcher.payloads("compaction.event")[0]["tokens_before"] == estimate
    assert result["tokens_after"] == (await session(http, auto))["token_count"]


async def turns_until_the_decider_fires(nats_url: str, http: httpx.AsyncClient,
                                        watcher: Watcher, sid: str) -> dict[str, Any]:
    """One turn at a time, each judged by the decider before the next, until it asks
    for a compaction: the history it judged is then the one compacted."""
    for turn in range(1, 13):
        assert (await http.post(f"/api/sessions/{sid}/messages",
                                json={"content": f"question {turn} !long 600"})).status_code == 200
        await watcher.wait_until(lambda: len(reports(watcher, sid)) >= turn, 20)  # noqa: B023
        await decider_caught_up(nats_url)
        requests = [p for p in watcher.payloads("compaction.request") if p["session_id"] == sid]
        if requests:
            return requests[0]
    raise AssertionError("the decider never asked for a compaction")


def reports(watcher: Watcher, sid: str) -> list[dict[str, Any]]:
    return [p for p in watcher.payloads("response.generation") if p["session_id"] == sid]


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
    # A background compaction is no turn phase (no turn ran meanwhile); the
    # session says compacting from its start to its result, then idle.
    assert watcher.payloads("generator.state") == []
    assert after["state"] == "idle" and after["phase"] == "idle"

    async with watching(private_nats.url, subjects.RESPONSE_GENERATION) as reports:
        await chat(http, sid, 3, filler=100, start=10)
        # Each report says what history it measured: the decider drops one read
        # after the result of a compaction it predates.
        await reports.wait_until(lambda: len(reports.payloads("response.generation")) == 3)
        assert [r["compactions"] for r in reports.payloads("response.generation")] == [1, 1, 1]
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        second = await next_result(watcher, sid)
    assert (first["compactions"], second["compactions"]) == (1, 2)
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
        # The summary is held until the three turns are answered: they are
        # answered during it by construction, not by outrunning it.
        await configure_stub(stub, held_models=["summariser"])
        await http.post(f"/api/sessions/{sid}/compact")
        await watcher.wait_for(lambda e: e.get("message_type") == "compaction.event")
        assert (await session(http, sid))["state"] == "compacting"
        during = await chat(http, sid, 3, filler=10, start=20)
        answered_while_compacting = not results(watcher, sid)
        await configure_stub(stub, held_models=[])
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
        await configure_stub(stub, held_models=["summariser"])  # until the query is refused
        await http.post(f"/api/sessions/{sid}/compact")
        await watcher.wait_for(lambda e: e.get("message_type") == "compaction.event")
        refused = await http.post(f"/api/sessions/{sid}/messages", json={"content": "now?"})
        await configure_stub(stub, held_models=[])
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


@pytest.mark.parametrize("level", ["gentle", "tighter", "emergency"])
async def test_every_summary_call_fits_the_summarisers_window_at_every_level(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient], level: str
) -> None:
    """The summariser (another model, with a window of its own) gets a zone far
    larger than its window: it is summarised in pieces, each within it."""
    http = start(NUM_CTX="8192", COMPACTION_THRESHOLD="0", COMPACTION_MODEL="writer",
                 COMPACTION_NUM_CTX="2048", COMPACTION_TAIL_TURNS="4")
    sid = await create(http)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "Port the parser."})
    await chat(http, sid, 12, filler=700)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await publish_request(private_nats.url, sid, level)
        result = await next_result(watcher, sid)
    assert (result["status"], result["method"], result["level"]) == (
        "completed", "summary", level), result
    assert result["summary"].startswith("Goal: Port the parser.")
    writer = (await stub_stats(stub))["models"]["writer"]
    assert writer["requests"] > 1  # in pieces
    assert writer["max_prompt_tokens"] <= 2048 - 256 and writer["truncated"] == 0


async def test_a_summariser_whose_own_window_is_smaller_gets_pieces_that_fit_it(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """No COMPACTION_NUM_CTX: the summariser's window is taken as NUM_CTX, but
    the model's own is a quarter of it. Pieces planned for NUM_CTX would be
    sent with the smaller window and lose their start (instructions first)."""
    http = start(NUM_CTX="8192", COMPACTION_THRESHOLD="0", COMPACTION_MODEL="small-writer",
                 COMPACTION_TAIL_TURNS="4")
    sid = await create(http)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "Port the parser."})
    await chat(http, sid, 12, filler=700)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await publish_request(private_nats.url, sid, "gentle")
        result = await next_result(watcher, sid)
    assert (result["status"], result["method"]) == ("completed", "summary"), result
    writer = (await stub_stats(stub))["models"]["small-writer"]
    assert writer["requests"] > 1  # in pieces
    assert writer["max_prompt_tokens"] <= SMALL_WRITER_WINDOW and writer["truncated"] == 0


@pytest.mark.parametrize("end", ["killed", "stopped"])
async def test_a_generator_ended_in_a_turns_compaction_leaves_no_session_compacting(
    private_nats: NatsServer, stub: str, end: str
) -> None:
    """gen-a is killed, or stopped, while the summary of a turn's emergency
    compaction is being written. Every compaction started gets its result:
    gen-a's is ended as failed, by gen-a as it stops, or by gen-b when the
    query comes back to it. Nothing else ended it (the turn's cancel skipped
    the result, and the compaction record named gen-a), and the session read
    compacting for good."""
    system = System(private_nats.url, stub, {**SMALL_WINDOW, "COMPACTION_MODEL": "summariser"},
                    services=("gateway",)).start()
    system.add("gen-a", "services.generator", {"GENERATOR_ID": "gen-a"}).start()
    try:
        async with system.http(timeout=60) as http, \
                watching(private_nats.url, *EVENTS) as watcher:
            sid = await create(http)  # no decider: only a turn compacts
            await configure_stub(stub, held_models=["summariser"])
            talk = asyncio.create_task(chat(http, sid, 12, filler=600))
            await watcher.wait_for(lambda e: e["payload"].get("event") == "started", 60)
            if end == "killed":
                system["gen-a"].kill()
            else:
                system["gen-a"].stop()
                await watcher.wait_for(lambda e: e["payload"].get("status") == "failed")
            await configure_stub(stub, held_models=[])
            system.add("gen-b", "services.generator", {"GENERATOR_ID": "gen-b"}).start()
            replies = await talk
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            assert (await session(http, sid))["state"] == "idle"
        started = [e["correlation_id"] for e in watcher.events
                   if e["payload"].get("event") == "started"]
        ended = [e["correlation_id"] for e in watcher.events
                 if e.get("message_type") == "compaction.result"]
        assert sorted(started) == sorted(ended)
        assert watcher.payloads("compaction.result")[0]["status"] == "failed"
    finally:
        system.stop()


async def test_a_stop_during_a_turns_compaction_ends_the_turn_with_the_history_as_it_was(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """The stop was answered 202, yet the turn wrote its whole summary (up to
    SUMMARY_TIMEOUT_S), made the compaction, which cannot be undone, and only
    then ended, stopped."""
    http = start(services=("generator", "gateway"), COMPACTION_MODEL="summariser")
    sid = await create(http)

    async def until_stopped() -> httpx.Response:
        for i in range(1, 40):
            reply = await http.post(f"/api/sessions/{sid}/messages",
                                    json={"content": f"question {i} !long 600"})
            if reply.json().get("stopped"):
                return reply
        raise AssertionError("no turn needed a compaction")

    async with watching(private_nats.url, *EVENTS, subjects.reply(sid)) as watcher:
        await configure_stub(stub, held_models=["summariser"])
        try:
            talk = asyncio.create_task(until_stopped())
            await watcher.wait_for(lambda e: e["payload"].get("event") == "started", 60)
            assert (await http.post(f"/api/sessions/{sid}/stop")).status_code == 202
            reply = await asyncio.wait_for(talk, 60)  # the summariser still held
            result = await next_result(watcher, sid)
            # The generator's reply comes after all it published before it.
            await watcher.wait_for(lambda e: e["payload"].get("stopped") is True, 60)
        finally:
            await configure_stub(stub, held_models=[])
    assert reply.status_code == 200 and reply.json()["reply"] == ""
    assert result["status"] == "skipped" and "stopped" in result["error"], result
    # Stopped, no second compaction (of the last turn too) is begun.
    assert len([e for e in watcher.payloads("compaction.event")
                if e.get("event") == "started"]) == 1
    context = await session(http, sid)
    assert context["compactions"] == 0 and context["state"] == "idle"
    assert context["messages"][-1] == {"role": "assistant", "stopped": True,
                                       "query_id": context["messages"][-1]["query_id"]}


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
