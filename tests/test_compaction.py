"""Compaction on real processes: manual and automatic, background and
blocking, what is kept, what is reported, and that no prompt ever overflows.

The window is small (NUM_CTX 2048, budget 1792 tokens) so a few turns of
`!long` answers fill it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import CompactionRequest, ToolOutcome
from services.shared.bus import Bus, round_trip
from tests.events import Watcher, decider_caught_up, watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, running_stub, stub_stats
from tests.system import System
from tests.tools_offered import offer_tools

NUM_CTX = 2048
SMALL_WINDOW = {"NUM_CTX": str(NUM_CTX), "COMPACTION_TAIL_TURNS": "2",
                "COMPACTION_COOLDOWN_S": "1"}
EVENTS = (subjects.COMPACTION_REQUEST, subjects.COMPACTION_EVENT, subjects.COMPACTION_RESULT,
          f"{subjects.STATE_PREFIX}.*")
SYSTEM_PROMPT = "You are a careful assistant. Answer briefly."


# A summariser whose own window is smaller than NUM_CTX.
SMALL_WRITER_WINDOW = 2048


@pytest.fixture
def stub() -> Iterator[str]:
    with running_stub("--model-latency", "summariser=1500",
                      "--context-length", f"small-writer={SMALL_WRITER_WINDOW}") as url:
        yield url


@pytest.fixture
async def start(private_nats: NatsServer, stub: str
                ) -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    """Start the system with settings of the test's own and hand back an HTTP
    client on it; everything is stopped after, even when the test fails."""
    systems: list[System] = []
    clients: list[httpx.AsyncClient] = []

    def starter(services: tuple[str, ...] = ("generator", "decider", "gateway"),
                **env: str) -> httpx.AsyncClient:
        systems.append(System(private_nats.url, stub, {**SMALL_WINDOW, **env},
                              services=services).start())
        clients.append(systems[-1].http(timeout=60))
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


def results(watcher: Watcher, sid: str) -> list[dict[str, Any]]:
    return [p for p in watcher.payloads("compaction.result") if p["session_id"] == sid]


async def next_result(watcher: Watcher, sid: str, count: int = 1) -> dict[str, Any]:
    await watcher.wait_until(lambda: len(results(watcher, sid)) >= count, 20)
    return results(watcher, sid)[count - 1]


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
        await decider_caught_up(private_nats.url)
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


async def serve_a_verbose_tool(nats_url: str, output: str = "line of output\n" * 150) -> Any:
    """A tool of the test's own on real NATS whose output is long."""
    nc = await nats.connect(nats_url)
    definition = [{"type": "function", "function": {
        "name": "dump", "description": "prints a lot", "parameters": {"type": "object"}}}]

    async def dump(msg: Msg) -> None:
        await msg.respond(Bus(nc, "tools").envelope(
            msg.subject, ToolOutcome(name="dump", content=output)
        ).model_dump_json().encode())

    await offer_tools(nc, definition)
    await nc.subscribe(subjects.tool("dump"), cb=dump)
    await round_trip(nc)
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


async def publish_request(nats_url: str, sid: str, level: str) -> None:
    """A compaction request at a given level, as the decider sends one."""
    nc = await nats.connect(nats_url)
    try:
        await Bus(nc, "compaction-decider").js_publish(
            subjects.COMPACTION_REQUEST,
            CompactionRequest(session_id=sid, auto=True, level=level,  # type: ignore[arg-type]
                              reason="test"), session_id=sid)
    finally:
        await nc.drain()


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


async def test_after_an_oversized_message_long_turns_never_overflow_any_call(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """One message larger than the window, then 25 turns of about 1,200
    characters: every call the stand-in receives fits, the summariser's too."""
    http = start()
    sid = await create(http)
    huge = await http.post(f"/api/sessions/{sid}/messages", json={"content": "x" * 20_000})
    assert huge.status_code == 413
    async with watching(private_nats.url, *EVENTS) as watcher:
        replies = [await http.post(f"/api/sessions/{sid}/messages",
                                   json={"content": f"question {i} " + "w" * 1200})
                   for i in range(25)]
        await decider_caught_up(private_nats.url)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    levels = {p["level"] for p in watcher.payloads("compaction.event")}
    assert "emergency" in levels, levels
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX - 256 and stats["truncated"] == 0


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


async def test_a_prompt_the_model_counts_longer_than_its_window_is_never_cut(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """The model's tokenizer counts four times what the session's rate says
    (a new model, say). The estimate finds the next prompt fits; sent without
    truncation, it is refused, the rates rise to the window it exceeds, and
    the turn is fitted again. Before, Ollama cut it silently (old messages,
    on some releases the system prompt) and answered what was left."""
    http = start(services=("generator", "gateway"))
    sid = await create(http)
    assert all(r.status_code == 200 for r in await chat(http, sid, 3, filler=1200))
    await configure_stub(stub, chars_per_token=1.0)
    reply = await http.post(f"/api/sessions/{sid}/messages",
                            json={"content": "question 4 !long 20"})
    assert reply.status_code == 200, reply.text  # after a compaction whose pieces learnt too
    assert reply.json()["reply"].startswith("Echo: question 4")
    stats = await stub_stats(stub)
    assert stats["truncated"] == 0 and stats["refused_too_long"] >= 1
    assert (await session(http, sid))["compactions"] == 1


async def test_an_answer_never_writes_past_the_window(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """A model that writes on and on: unbounded, Ollama lets it write ten
    windows' worth, dropping the start of the prompt (the system prompt) to
    make room. The answer gets what the prompt leaves of the window."""
    http = start(services=("generator", "gateway"))
    sid = await create(http)
    reply = await http.post(f"/api/sessions/{sid}/messages",
                            json={"content": "tell me everything !long 20000"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_tokens"] + body["completion_tokens"] <= NUM_CTX


async def test_a_session_goes_on_after_an_answer_that_wrote_all_it_could(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """An answer that filled what its prompt left of the window made a last
    turn larger than the budget: kept raw by every compaction, it left each
    later message refused as too long, a manual compaction skipped, and a
    retry wrote it again. Its turn now keeps room for the next question."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http)
    await chat(http, sid, 3, filler=10)
    long = await http.post(f"/api/sessions/{sid}/messages",
                           json={"content": "tell me everything !long 100000"})
    assert long.status_code == 200, long.text
    retried = await http.post(f"/api/sessions/{sid}/retry")
    assert retried.status_code == 200, retried.text
    for content in ("and now?", "thanks"):
        reply = await http.post(f"/api/sessions/{sid}/messages", json={"content": content})
        assert reply.status_code == 200, reply.text


async def test_a_session_goes_on_after_a_question_near_the_budget(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """A question of some 80 % of the budget, answered: as the last turn, kept
    raw by an emergency compaction, it left no room for any next message,
    each refused as one no compaction could make room for. The turn after it
    now has everything summarised, that turn too; the transcript keeps all."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http)
    await chat(http, sid, 2, filler=10)
    question = "y " * 2900 + "!long 5000"  # and an answer as long as it may be
    large = await http.post(f"/api/sessions/{sid}/messages", json={"content": question})
    assert large.status_code == 200, large.text
    after = await http.post(f"/api/sessions/{sid}/messages", json={"content": "and now?"})
    assert after.status_code == 200, after.text
    context = await session(http, sid)
    assert context["compactions"] == 1
    assert context["messages"][0]["content"] == "and now?"
    said = (await http.get(f"/api/sessions/{sid}/transcript")).json()["items"]
    assert question in [item.get("content") for item in said]


async def test_a_summary_larger_than_the_minimal_one_does_not_refuse_the_message(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """The emergency compaction keeps the last turn when a minimal summary
    would leave room; the summary written was larger (here, larger than what
    it replaced, so it was not kept), and the message was refused. The last
    turn is then summarised too."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http)
    for content in ("first !summary 1200 " + "w " * 400, "y " * 1000):
        assert (await http.post(f"/api/sessions/{sid}/messages",
                                json={"content": content})).status_code == 200
    asked = await http.post(f"/api/sessions/{sid}/messages", json={"content": "z " * 2100})
    assert asked.status_code == 200, asked.text
    context = await session(http, sid)
    assert context["compactions"] == 1 and context["messages"][0]["content"] == "z " * 2100


async def test_a_paste_no_compaction_could_fit_is_refused_with_the_history_untouched(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """30,000 characters (7,500 tokens against a limit of 6,809): no emergency
    compaction, no model call, 413 at once."""
    http = start(NUM_CTX="8192", COMPACTION_THRESHOLD="0.95")
    sid = await create(http)
    await chat(http, sid, 4, filler=2000)
    before = await session(http, sid)
    sent_before = (await stub_stats(stub))["requests"]
    async with watching(private_nats.url, *EVENTS) as watcher:
        paste = await http.post(f"/api/sessions/{sid}/messages", json={"content": "x" * 30_000})
        await chat(http, sid, 1, filler=10, start=9)  # events of the paste are out by now
    assert paste.status_code == 413, paste.text
    assert "no compaction could make room" in paste.json()["error"]["message"]
    assert not watcher.payloads("compaction.event")
    assert (await stub_stats(stub))["requests"] == sent_before + 1  # the next turn's only
    after = await session(http, sid)
    assert after["compactions"] == 0 and after["messages"][:-2] == before["messages"]


async def test_a_tool_result_larger_than_the_window_is_cut_and_the_turn_answered(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    tools = await serve_a_verbose_tool(private_nats.url, "#start " + "o" * 60_000)
    try:
        http = start()
        sid = await create(http)
        await chat(http, sid, 2, filler=50)
        reply = await http.post(f"/api/sessions/{sid}/messages", json={"content": "!tool dump"})
        # Cut to leave room: the session goes on (its last turn is kept raw).
        following = await chat(http, sid, 2, filler=300, start=5)
    finally:
        await tools.drain()
    assert reply.status_code == 200, reply.text
    assert all(r.status_code == 200 for r in following), [r.text for r in following]
    stored = [m for m in (await session(http, sid))["messages"] if m["role"] == "tool"]
    assert stored[0]["content"].startswith("#start ooo")
    assert "characters left out here: too long to send whole" in stored[0]["content"]
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX - 256 and stats["truncated"] == 0
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


@pytest.mark.parametrize("turns_before", [0, 1])
async def test_with_automatic_compaction_off_a_compaction_asked_for_frees_a_full_session(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient],
    turns_before: int,
) -> None:
    """Automatic compaction off, one answer that wrote all it could: every
    message after it was refused with the advice to compact, and that
    compaction was skipped, the whole history being within the raw tail.
    Asked for by a person on a context past the emergency line, it now keeps
    fewer turns raw, down to none."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http, auto_compact=False)
    await chat(http, sid, turns_before, filler=10)  # kept raw, it would leave the long one too
    long = await http.post(f"/api/sessions/{sid}/messages",
                           json={"content": "tell me everything !long 100000"})
    assert long.status_code == 200, long.text
    refused = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hi"})
    assert refused.status_code == 413, refused.text
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        result = await next_result(watcher, sid)
    assert result["status"] == "completed", result
    answered = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hi"})
    assert answered.status_code == 200, answered.text
    said = (await http.get(f"/api/sessions/{sid}/transcript")).json()["items"]
    assert [item["role"] for item in said if item.get("role")][:2] == ["user", "assistant"]
