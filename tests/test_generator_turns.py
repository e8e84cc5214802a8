"""A turn through the generator on real processes: its published state
transitions, streaming, tool calls, and every way the model can fail."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from schemas import subjects
from schemas.history import ToolCall
from schemas.messages import Reply, ToolOutcome
from services.generator.answered import AnsweredQueries
from services.generator.toolbox import Toolbox
from services.shared.bus import Bus, round_trip
from tests.events import server_sent_events, transitions, turns_finished, watching
from tests.nats_server import NatsServer, free_port
from tests.stub_server import configure_stub, running_stub
from tests.system import System, ask, new_session, running_system
from tests.tools_offered import offer_tools

TURN = [
    ("idle", "receiving", "receive"),
    ("receiving", "generating", "start_generation"),
    ("generating", "publishing", "publish"),
    ("publishing", "idle", "reset"),
]


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    """A stand-in of this module's own: tests here switch its quirks on and off."""
    with running_stub() as url:
        yield url


@pytest.fixture(scope="module")
def system(nats_url: str, stub: str) -> Iterator[System]:
    # Limits no stall of a busy machine reaches: the one test that needs a
    # model call to time out has a system of its own.
    env = {"OLLAMA_TIMEOUT_S": "60", "TOOL_TIMEOUT_S": "30"}
    with running_system(nats_url, stub, env,
                        services=("generator", "gateway", "tools")) as running:
        yield running


@pytest.fixture
async def http(system: System, stub: str) -> AsyncIterator[httpx.AsyncClient]:
    async with system.http(timeout=30) as client:
        yield client
    await configure_stub(stub, quirks=[])


async def create(http: httpx.AsyncClient) -> str:
    return str((await http.post("/api/sessions", json={})).json()["session_id"])


async def test_every_transition_of_a_turn_is_published(system: System, nats_url: str,
                                                        http: httpx.AsyncClient) -> None:
    sid = await create(http)
    async with watching(nats_url, f"{subjects.STATE_PREFIX}.*") as watcher:
        await http.post(f"/api/sessions/{sid}/messages", json={"content": "hi"})
        await watcher.wait_for(lambda e: e["payload"].get("action") == "reset")
    assert transitions(watcher, sid) == TURN
    assert {p["generator_id"] for p in watcher.payloads()} != {""}
    assert (await http.get(f"/api/sessions/{sid}")).json()["state"] == "idle"


async def test_tool_calls_run_through_the_tool_states_and_are_stored(
    system: System, nats_url: str, http: httpx.AsyncClient
) -> None:
    sid = await create(http)
    async with watching(nats_url, f"{subjects.STATE_PREFIX}.*",
                        subjects.RESPONSE_GENERATION) as watcher:
        reply = await http.post(f"/api/sessions/{sid}/messages", json={
            "content": '!tool word_count {"text": "one two three"}'})
        await watcher.wait_for(lambda e: e["subject"] == subjects.RESPONSE_GENERATION)
        await turns_finished(watcher, sid, 1)
    assert reply.json()["reply"] == "tool results: 3 words, 1 lines, 13 characters"
    assert transitions(watcher, sid) == [
        *TURN[:2],
        ("generating", "dispatching_tool", "dispatch_tool"),
        ("dispatching_tool", "waiting_for_tool", "await_result"),
        ("waiting_for_tool", "generating", "tool_result"),
        *TURN[2:],
    ]
    messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"] == [{"name": "word_count",
                                          "arguments": {"text": "one two three"}}]
    assert messages[2]["tool_name"] == "word_count"
    report = watcher.payloads("response.generation")[0]
    # The last call sent the tool call (with its arguments) and its result.
    assert report["sent_chars"] > len(json.dumps(messages[1]["tool_calls"])) + 40


async def test_answers_stream_as_server_sent_events(http: httpx.AsyncClient) -> None:
    sid = await create(http)
    events: list[tuple[str, dict[str, object]]] = []
    async with http.stream("POST", f"/api/sessions/{sid}/messages",
                           json={"content": "stream this please"},
                           headers={"Accept": "text/event-stream"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [event async for event in server_sent_events(response)]
    names = [n for n, _ in events]
    assert names[-1] == "done" and names.count("done") == 1
    assert names.count("token") >= 3
    done = events[-1][1]
    tokens = "".join(str(d["text"]) for n, d in events if n == "token")
    assert tokens == done["reply"] == "Echo: stream this please (turn 1)"
    assert set(done) == {"session_id", "query_id", "reply", "prompt_tokens",
                         "completion_tokens"}


async def test_a_streamed_answer_with_a_tool_call_is_numbered_as_one(
        http: httpx.AsyncClient) -> None:
    """Text streamed before a tool call, then the answer after its result: the
    second call's tokens follow the first's, so no `restart` wipes the answer.
    (The second turn's first call may be a head start, whose stream is the turn's.)"""
    sid = await create(http)
    for _ in range(2):
        await streams_one_numbering(http, sid)


async def streams_one_numbering(http: httpx.AsyncClient, sid: str) -> None:
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={
            "content": '!lead "Let me check" !tool word_count {"text": "one two"}'},
            headers={"Accept": "text/event-stream"}) as response:
        events = [event async for event in server_sent_events(response)]
    names = [n for n, _ in events]
    assert "restart" not in names and names[-1] == "done", names
    tokens = [d for n, d in events if n == "token"]
    assert [d["index"] for d in tokens] == list(range(len(tokens)))
    text = "".join(str(d["text"]) for d in tokens)
    assert text.startswith("Let me check") and text.endswith(str(events[-1][1]["reply"]))
    assert text.startswith("Let me check\n\ntool results: ")  # each call's text apart
    assert str(events[-1][1]["reply"]).startswith("tool results: ")


@pytest.mark.parametrize("quirk, status, code", [
    ("error", 502, "provider_error"),
    ("empty-content", 502, "empty_reply"),
])
async def test_model_failures_give_a_clear_error_and_leave_the_session_clean(
    stub: str, http: httpx.AsyncClient, quirk: str, status: int, code: str
) -> None:
    await fails_cleanly(http, stub, quirk, status, code)


async def test_a_model_that_never_answers_times_out_and_leaves_the_session_clean(
        private_nats: NatsServer) -> None:
    with running_stub() as stub, running_system(
            private_nats.url, stub, {"OLLAMA_TIMEOUT_S": "1.5"},
            services=("generator", "gateway")) as short:
        async with short.http(timeout=30) as http:
            await fails_cleanly(http, stub, "hang", 504, "timeout")


async def test_an_answer_ended_without_its_done_chunk_is_kept_without_counts(
        stub: str, http: httpx.AsyncClient) -> None:
    """Ollama ends a model repeating itself so, with no counts: what came is
    the answer, stored, and the session goes on."""
    sid = await create(http)
    await configure_stub(stub, quirks=["no-done"])
    whole = await http.post(f"/api/sessions/{sid}/messages", json={"content": "whole"})
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": "parts"},
                           headers={"Accept": "text/event-stream"}) as response:
        events = [event async for event in server_sent_events(response)]
    assert whole.status_code == 200, whole.text
    assert whole.json()["reply"] == "Echo: whole (turn 1)"
    assert whole.json()["prompt_tokens"] is None
    assert events[-1] == ("done", {**events[-1][1], "reply": "Echo: parts (turn 2)"})
    await configure_stub(stub, quirks=[])
    again = await http.post(f"/api/sessions/{sid}/messages", json={"content": "again"})
    assert again.json()["reply"] == "Echo: again (turn 3)"
    assert again.json()["prompt_tokens"] > 0


async def fails_cleanly(http: httpx.AsyncClient, stub: str, quirk: str, status: int,
                        code: str) -> None:
    sid = await create(http)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "works"})
    await configure_stub(stub, quirks=[quirk])
    failed = await http.post(f"/api/sessions/{sid}/messages", json={"content": "fails"})
    assert failed.status_code == status, failed.text
    assert failed.json()["error"]["code"] == code
    session = (await http.get(f"/api/sessions/{sid}")).json()
    assert session["state"] == "idle"
    assert [m["content"] for m in session["messages"]] == ["works", "Echo: works (turn 1)"]
    await configure_stub(stub, quirks=[])
    # The lock was released: the very next query is answered at once.
    again = await http.post(f"/api/sessions/{sid}/messages", json={"content": "again"})
    assert again.json()["reply"] == "Echo: again (turn 2)"


async def test_a_model_that_keeps_calling_tools_is_stopped(http: httpx.AsyncClient,
                                                          nats_url: str) -> None:
    sid = await create(http)
    async with watching(nats_url, subjects.tool("calculate")) as calls:
        looping = await http.post(f"/api/sessions/{sid}/messages", json={
            "content": '!toolloop !tool calculate {"expression": "1+1"}'})
    # MAX_TOOL_ITERATIONS rounds of tools, not one more whose result is thrown away.
    assert len(calls.payloads()) == 5
    assert looping.status_code == 502
    assert looping.json()["error"] == {
        "code": "tool_loop_limit",
        "message": "the model kept calling tools after 5 rounds"}
    session = (await http.get(f"/api/sessions/{sid}")).json()
    assert session["messages"] == [] and session["state"] == "idle"


def test_an_unreachable_model_is_named_as_such(private_nats: NatsServer) -> None:
    # A NATS of its own: the module's healthy generator must not answer for it.
    dead = f"http://127.0.0.1:{free_port()}"
    with running_system(private_nats.url, dead, services=("generator", "gateway")) as system, \
            system.client() as client:
        sid = new_session(client)
        failed = ask(client, sid, "anyone there?")
        assert failed.status_code == 502
        assert failed.json()["error"]["code"] == "unreachable"
        assert dead.removeprefix("http://") in failed.json()["error"]["message"]
        assert client.get(f"/api/sessions/{sid}").json()["messages"] == []


async def test_nats_not_answering_for_too_long_is_told_as_503(
        private_nats: NatsServer, stub: str) -> None:
    """The history stream is gone (as while its leader is elected): the turn
    cannot be stored, and past the patience the caller is told to try again."""
    env = {"NATS_AWAY_PATIENCE_S": "0.5"}
    with running_system(private_nats.url, stub, env,
                        services=("generator", "gateway")) as system, system.client() as client:
        sid = new_session(client)
        nc = await nats.connect(private_nats.url)
        await nc.jetstream().delete_stream(subjects.HISTORY_STREAM)
        await nc.close()
        failed = ask(client, sid, "anyone there?")
        assert failed.status_code == 503
        assert failed.json()["error"]["code"] == "nats_unavailable"


async def never_answer(msg: Msg) -> None:
    """A subscriber that takes requests and lets them time out."""
    return None


async def tool_responder(nc: nats.aio.client.Client) -> None:
    """Tools of this test's own, answering on real NATS: one slow, one failing."""
    definitions = [{"type": "function", "function": {"name": n, "description": n,
                                                     "parameters": {"type": "object"}}}
                   for n in ("slow", "broken", "absent")]

    async def broken(msg: Msg) -> None:
        await msg.respond(Bus(nc, "tools").envelope(
            msg.subject, ToolOutcome(name="broken", error="ValueError: boom")
        ).model_dump_json().encode())

    await offer_tools(nc, definitions)
    await nc.subscribe(subjects.tool("broken"), cb=broken)
    await nc.subscribe(subjects.tool("slow"), cb=never_answer)


async def test_tool_failures_reach_the_model_as_clear_errors(private_nats: NatsServer) -> None:
    # A NATS of its own: no tools service may answer `tool.list` here.
    nc = await nats.connect(private_nats.url)
    await tool_responder(nc)
    # Only the tool that never answers may run out of time: a short wait for
    # the others could expire on a busy machine.
    patient = Toolbox(Bus(nc, "generator"), timeout_s=30)
    impatient = Toolbox(Bus(nc, "generator"), timeout_s=0.3)

    async def run(name: str) -> str:
        toolbox = impatient if name == "slow" else patient
        outcome = await toolbox.run(ToolCall(name=name), "q1", "c1")
        assert outcome.timed_out == (name == "slow")
        return outcome.message.content

    assert await run("nosuch") == "error: unknown tool 'nosuch'"
    assert await run("slow") == "error: tool 'slow' timed out after 0.3 s"
    assert await run("broken") == "error: tool 'broken' failed: ValueError: boom"
    assert await run("absent") == "error: tool 'absent' is not available right now"
    await nc.drain()


def confirmation(confirmed: bool | None) -> asyncio.Future[bool]:
    """The server's word on an acknowledgement; None: not come yet."""
    future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    if confirmed is not None:
        future.set_result(confirmed)
    return future


async def test_answered_queries_are_remembered_up_to_a_bound() -> None:
    answered = AnsweredQueries(size=3)
    for seq in (10, 11, 12, 13):
        answered.remember(seq, Reply(session_id="s", query_id=f"q{seq}", reply="fine"),
                          confirmation(True))
    assert not await answered.acknowledged(10)
    assert all([await answered.acknowledged(seq) for seq in (11, 12, 13)])
    assert answered.count == 4


async def test_only_an_acknowledgement_the_server_confirmed_counts_as_done() -> None:
    """The ordering check skips an earlier query only once the server took
    its acknowledgement: one refused or lost leaves the query to come back,
    and the session's later queries must wait for it."""
    answered = AnsweredQueries()
    fine = Reply(session_id="s", query_id="q", reply="fine")
    answered.remember(1, fine, confirmation(False))
    assert not await answered.acknowledged(1)
    on_its_way = confirmation(None)
    answered.remember(2, fine, on_its_way)
    waiting = asyncio.ensure_future(answered.acknowledged(2))
    await asyncio.sleep(0)
    assert not waiting.done()  # waits for the server's word
    on_its_way.set_result(True)
    assert await waiting


async def test_only_error_replies_are_kept_to_be_sent_again() -> None:
    """An answer is in the history; an error reply is nowhere else, and is
    kept even when its acknowledgement was never confirmed."""


async def test_an_answered_sequence_of_a_stream_made_anew_is_another_query() -> None:
    """NATS came back without its store: sequences start from 1 again."""
    answered = AnsweredQueries()
    answered.remember(1, Reply(session_id="s", query_id="old", reply="fine"), confirmation(True))
    assert await answered.acknowledged(1, "old") and await answered.acknowledged(1, None)
    assert not await answered.acknowledged(1, "new")
    answered = AnsweredQueries()
    failed = Reply(session_id="s", query_id="q1", error="no model", error_code="ollama_error")
    answered.remember(1, failed, confirmation(False))
    answered.remember(2, Reply(session_id="s", query_id="q2", reply="fine"), confirmation(True))
    assert answered.error_reply(1, "q1") == failed
    assert answered.error_reply(1, "another query") is None  # the stream was made anew
    assert answered.error_reply(2, "q2") is None and await answered.acknowledged(2)


async def test_bookkeeping_after_a_reply_does_not_hold_the_sessions_slot(
        private_nats: NatsServer, stub_url: str) -> None:
    # One slot, and a report that hangs: its stream is gone and a silent
    # subscriber takes the publish, so the follow-up waits out its timeout.
    nc = await nats.connect(private_nats.url)
    env = {"MAX_CONCURRENT_SESSIONS": "1"}
    services = ("generator", "gateway")
    with running_system(private_nats.url, stub_url, env, services=services) as system:
        async with system.http(timeout=30) as http:
            sid = await create(http)
            await nc.jetstream().delete_stream(subjects.GENERATIONS_STREAM)
            reports = await nc.subscribe(subjects.RESPONSE_GENERATION)  # never answers
            await round_trip(nc)
            assert (await http.post(f"/api/sessions/{sid}/messages",
                                    json={"content": "one"})).status_code == 200
            await reports.next_msg(timeout=10)  # the first turn's report, hanging now
            reply = await nc.request(subjects.service_status("generator"), b"", timeout=5)
            status = json.loads(reply.data)
            assert status["free_slots"] == 1  # the slot is free while the report hangs
            second = await http.post(f"/api/sessions/{sid}/messages", json={"content": "two"})
            assert second.status_code == 200
    await nc.close()
