"""Stop and retry on real processes, with the stand-in writing long answers
slowly (`!long N` at `--ms-per-token`): a stopped answer ends the model call
and is stored as far as it got, and a retried one takes the old one's place
in the context while the stored turns keep both."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import httpx
import nats
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from schemas import subjects
from schemas.history import HistoryEntry
from schemas.messages import Query, Reply
from services.shared.bus import Bus, decode
from services.shared.query_errors import QueryErrors
from tests import slow_answers
from tests.events import (
    Watcher,
    eventually,
    server_sent_events,
    transitions,
    turns_finished,
    watching,
)
from tests.nats_server import NatsServer
from tests.slow_answers import LONG, SSE, create
from tests.stub_server import stub_stats
from tests.system import System, running_system
from tests.tools_offered import offer_tools

# The slow system's fixtures, by their names in this module.
stub, system, http = slow_answers.stub, slow_answers.system, slow_answers.http


async def stopped_mid_stream(http: httpx.AsyncClient, sid: str, tokens: int = 3,
                             before_stop: Any = None, retry: bool = False
                             ) -> tuple[dict[str, Any], str, Any]:
    """Ask the long question (or retry it), stop it after a few tokens; the
    `done` event's data, the text streamed, and the stop's response."""
    streamed: list[str] = []
    stop: Any = None
    path, body = ("retry", None) if retry else ("messages", {"content": LONG})
    async with http.stream("POST", f"/api/sessions/{sid}/{path}", json=body,
                           headers=SSE) as response:
        async for name, data in server_sent_events(response):
            if name == "token":
                streamed.append(data["text"])
                if len(streamed) == tokens:
                    if before_stop is not None:
                        await before_stop()
                    stop = await http.post(f"/api/sessions/{sid}/stop")
            elif name in ("done", "error"):
                assert name == "done", data
                return data, "".join(streamed), stop
    raise AssertionError("the stream ended without a done event")


async def stored_entries(nats_url: str, sid: str) -> list[HistoryEntry]:
    nc = await nats.connect(nats_url)
    try:
        js, entries, start = nc.jetstream(), [], 1
        while True:
            try:
                msg = await js.get_msg(subjects.HISTORY_STREAM, seq=start,
                                       subject=subjects.history(sid), next=True, direct=True)
            except NotFoundError:
                return entries
            entries.append(HistoryEntry.model_validate_json(msg.data or b"{}"))
            start = int(msg.seq or 0) + 1
    finally:
        await nc.close()


async def test_a_stop_mid_stream_ends_the_call_and_stores_the_partial_answer(
    http: httpx.AsyncClient, stub: str,
) -> None:
    sid = await create(http)
    cut_before = (await stub_stats(stub))["streams_cut"]
    done, streamed, stop = await stopped_mid_stream(http, sid)
    assert stop.status_code == 202, stop.text
    assert done["stopped"] is True
    assert done["reply"].startswith(streamed) and len(done["reply"]) < 40000
    await eventually(lambda: _more_cut(stub, cut_before), "the model server saw its client go")
    session = (await http.get(f"/api/sessions/{sid}")).json()
    answer = session["messages"][-1]
    assert answer["role"] == "assistant" and answer["stopped"] is True
    assert answer["content"] == done["reply"]
    assert session["state"] == "idle"
    # When it went idle: the page passes over live changes older than that.
    assert datetime.fromisoformat(session["state_at"]) <= datetime.now(UTC)
    assert session["state_by"]  # which generator's clock says so
    # The session goes on as usual, its lock free.
    nxt = await http.post(f"/api/sessions/{sid}/messages", json={"content": "and now?"})
    assert nxt.status_code == 200, nxt.text
    assert nxt.json()["reply"] == "Echo: and now? (turn 2)"
    assert "stopped" not in nxt.json()


async def _more_cut(stub: str, before: int) -> bool:
    return (await stub_stats(stub))["streams_cut"] > before


async def test_a_stopped_json_caller_gets_a_reply_marked_stopped(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    sid = await create(http)
    async with watching(nats_url, subjects.token(sid)) as tokens:
        asked = asyncio.create_task(
            http.post(f"/api/sessions/{sid}/messages", json={"content": LONG}))
        # Nobody streams this answer, so wait for the turn to run instead.
        await _until_generating(http, sid)
        stop = await http.post(f"/api/sessions/{sid}/stop")
        reply = await asked
    assert stop.status_code == 202, stop.text
    assert reply.status_code == 200 and reply.json()["stopped"] is True
    assert not tokens.payloads(), "tokens were published though the caller did not stream"
    # The caller was shown nothing of the answer, and nothing of it is kept.
    answer = (await http.get(f"/api/sessions/{sid}")).json()["messages"][-1]
    assert answer == {"role": "assistant", "query_id": answer["query_id"], "stopped": True}


async def _until_generating(http: httpx.AsyncClient, sid: str) -> None:
    async def generating() -> bool:
        return bool((await http.get(f"/api/sessions/{sid}")).json()["phase"] == "generating")
    await eventually(generating, "an answer under way")


async def test_stop_with_nothing_running_is_a_conflict(http: httpx.AsyncClient) -> None:
    sid = await create(http)
    stop = await http.post(f"/api/sessions/{sid}/stop")
    assert stop.status_code == 409
    assert stop.json()["error"]["code"] == "nothing_running"
    assert (await http.post("/api/sessions/nosuchsession/stop")).status_code == 404


async def test_a_query_queued_behind_the_stopped_one_is_answered_as_usual(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    sid = await create(http)
    later: list[asyncio.Task[httpx.Response]] = []
    async with watching(nats_url, subjects.query(sid)) as queries:
        async def queue_another() -> None:
            later.append(asyncio.create_task(http.post(
                f"/api/sessions/{sid}/messages", json={"content": "next one"})))
            await queries.wait_until(lambda: len(queries.payloads("chat.query")) == 2)

        done, _, stop = await stopped_mid_stream(http, sid, before_stop=queue_another)
    assert stop.status_code == 202 and done["stopped"] is True
    answer = await later[0]
    assert answer.status_code == 200, answer.text
    assert answer.json()["reply"] == "Echo: next one (turn 2)"


async def test_a_stop_under_a_queued_messages_key_withdraws_it_and_leaves_the_other_answer(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    """The page's Stop for its message, queued behind another client's answer:
    that other answer goes on, and the queued message is withdrawn at once,
    never sent to the model and not stored (it was answered after, unstoppable)."""
    sid = await create(http)
    queued = {"Idempotency-Key": "queued-message"}
    later: list[asyncio.Task[httpx.Response]] = []
    stops: list[httpx.Response] = []
    async with watching(nats_url, subjects.query(sid)) as queries:
        async def queue_another_and_stop_it() -> None:
            later.append(asyncio.create_task(http.post(
                f"/api/sessions/{sid}/messages", json={"content": "next one"}, headers=queued)))
            await queries.wait_until(lambda: len(queries.payloads("chat.query")) == 2)
            stops.append(await http.post(f"/api/sessions/{sid}/stop", headers=queued))
            withdrawn = await later[0]  # told before the answer ahead of it ends
            assert withdrawn.status_code == 409, withdrawn.text
            assert withdrawn.json()["error"]["code"] == "withdrawn"

        done, _, stop = await stopped_mid_stream(
            http, sid, before_stop=queue_another_and_stop_it)
    assert stops[0].status_code == 202, stops[0].text
    assert stops[0].json()["status"] == "withdrawn"
    assert stop.status_code == 202 and done["stopped"] is True  # stopped by its own caller
    nxt = await http.post(f"/api/sessions/{sid}/messages", json={"content": "and then"})
    assert nxt.json()["reply"] == "Echo: and then (turn 2)"
    contents = [m.get("content") for m in (await http.get(f"/api/sessions/{sid}")).json()[
        "messages"] if m["role"] == "user"]
    assert contents == [LONG, "and then"]
    # Sent again under its key, it is still withdrawn, not answered.
    again = await http.post(f"/api/sessions/{sid}/messages", json={"content": "next one"},
                            headers=queued)
    assert again.status_code == 409 and again.json()["error"]["code"] == "withdrawn"


async def test_retry_keeps_both_answers_stored_and_one_in_the_context(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    sid = await create(http)
    first = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hello"})
    assert first.status_code == 200, first.text
    again = await http.post(f"/api/sessions/{sid}/retry")
    assert again.status_code == 200, again.text
    assert again.json()["reply"] == "Echo: hello (turn 1)"
    messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    entries = await stored_entries(nats_url, sid)
    assert len(entries) == 2
    old, new = entries[0].messages[-1], entries[1].messages[-1]
    assert old.role == new.role == "assistant" and old.query_id != new.query_id
    assert entries[1].supersedes == old.query_id
    assert messages[1]["query_id"] == new.query_id
    # A second retry replaces the retried answer, and the conversation goes on from it.
    assert (await http.post(f"/api/sessions/{sid}/retry")).status_code == 200
    nxt = await http.post(f"/api/sessions/{sid}/messages", json={"content": "more"})
    assert nxt.json()["reply"] == "Echo: more (turn 2)"
    roles = [m["role"] for m in (await http.get(f"/api/sessions/{sid}")).json()["messages"]]
    assert roles == ["user", "assistant", "user", "assistant"]


async def test_retry_streams_like_a_message(http: httpx.AsyncClient) -> None:
    sid = await create(http)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "hi"})
    async with http.stream("POST", f"/api/sessions/{sid}/retry", headers=SSE) as response:
        events = [(name, data) async for name, data in server_sent_events(response)]
    assert events[-1][0] == "done" and events[-1][1]["reply"] == "Echo: hi (turn 1)"
    assert "".join(d["text"] for n, d in events if n == "token") == "Echo: hi (turn 1)"


async def test_retry_while_a_turn_runs_or_with_nothing_asked_is_a_conflict(
    http: httpx.AsyncClient,
) -> None:
    sid = await create(http)
    empty = await http.post(f"/api/sessions/{sid}/retry")
    assert empty.status_code == 409 and empty.json()["error"]["code"] == "nothing_to_retry"
    retried: list[httpx.Response] = []

    async def retry_now() -> None:
        retried.append(await http.post(f"/api/sessions/{sid}/retry"))

    done, _, _ = await stopped_mid_stream(http, sid, before_stop=retry_now)
    assert retried[0].status_code == 409
    assert retried[0].json()["error"]["code"] == "turn_running"
    assert done["stopped"] is True
    # The stopped answer can be retried (and stopped): the fresh one replaces it.
    again, _, stop = await stopped_mid_stream(http, sid, tokens=5, retry=True)
    assert stop.status_code == 202 and again["stopped"] is True
    messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == again["reply"]
    assert messages[1]["query_id"] != messages[0]["query_id"]  # the retry's answer


async def test_a_stop_reaches_whichever_generator_runs_the_answer(
    private_nats: NatsServer, stub: str,
) -> None:
    system = System(private_nats.url, stub, services=("gateway",)).start()
    for name in ("gen-a", "gen-b"):
        system.add(name, "services.generator", {"GENERATOR_ID": name}).start()
    try:
        async with (system.http(timeout=60) as http,
                    watching(private_nats.url, f"{subjects.STATE_PREFIX}.*") as states):
            holders = set()
            for _ in range(4):  # enough sessions that each generator runs some, mostly
                sid = await create(http)
                done, _, stop = await stopped_mid_stream(http, sid)
                assert stop.status_code == 202, stop.text
                assert done["stopped"] is True
                holder = _runner(states, sid)
                assert stop.json()["generator_id"] == holder
                holders.add(holder)
                nxt = await http.post(f"/api/sessions/{sid}/messages", json={"content": "on"})
                assert nxt.json()["reply"] == "Echo: on (turn 2)"
    finally:
        system.stop()
    assert holders <= {"gen-a", "gen-b"}


def _runner(states: Watcher, sid: str) -> str:
    started = [p["generator_id"] for p in states.payloads("generator.state")
               if p["session_id"] == sid and p["action"] == "start_generation"]
    return str(started[0])



async def test_a_stop_while_a_tool_call_waits_ends_the_answer_there(
        private_nats: NatsServer, stub: str) -> None:
    """The tool does not answer. The stop was answered 202, yet the turn waited
    out the call (TOOL_TIMEOUT_S), stored its timeout as the tool's result,
    and only then ended: the answer is stopped where it was."""
    nc = await nats.connect(private_nats.url)
    called = asyncio.Event()

    async def never_answers(msg: Msg) -> None:
        called.set()

    await offer_tools(nc, [{"type": "function", "function": {
        "name": "wait", "description": "takes its time",
        "parameters": {"type": "object", "properties": {}}}}])
    await nc.subscribe(subjects.tool("wait"), cb=never_answers)
    try:
        with running_system(private_nats.url, stub, {"TOOL_TIMEOUT_S": "120"},
                            services=("generator", "gateway")) as running:
            async with running.http(timeout=60) as client, \
                    watching(private_nats.url, f"{subjects.STATE_PREFIX}.*") as states:
                sid = await create(client)
                asked = asyncio.create_task(client.post(
                    f"/api/sessions/{sid}/messages",
                    json={"content": '!lead "Looking" !tool wait {}'}))
                await asyncio.wait_for(called.wait(), 30)
                assert (await client.post(f"/api/sessions/{sid}/stop")).status_code == 202
                reply = await asyncio.wait_for(asked, 60)
                assert reply.status_code == 200 and reply.json()["stopped"] is True
                messages = (await client.get(f"/api/sessions/{sid}")).json()["messages"]
                await turns_finished(states, sid, 1)
    finally:
        await nc.close()
    # Said as what it was: a stop, not a tool's timeout.
    assert ("waiting_for_tool", "generating", "stop") in transitions(states, sid)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[-1]["stopped"] is True and messages[-1]["content"] == "Looking"


async def answered_then_no_generator(http: httpx.AsyncClient, system: System,
                                     content: str) -> tuple[str, str]:
    """A new session whose first message is answered, then its generator
    stopped: nothing takes the queue from here on. The session's id and the
    answer's query id."""
    sid = await create(http)
    first = await http.post(f"/api/sessions/{sid}/messages", json={"content": content})
    assert first.status_code == 200, first.text
    system["generator"].stop()
    return sid, first.json()["query_id"]


async def test_a_retry_is_not_refused_for_a_failed_query_still_in_the_queue(
        private_nats: NatsServer, stub: str) -> None:
    """The work queue drops a query a moment after its acknowledgement: one
    that failed, its error reply sent and kept, read as a message still
    waiting, and a retry right after the failure was refused `turn_running`."""
    system = System(private_nats.url, stub, {"REPLY_TIMEOUT_S": "1"},
                    services=("generator", "gateway")).start()
    try:
        async with system.http() as http:
            sid, _ = await answered_then_no_generator(http, system, "first")
            nc = await nats.connect(private_nats.url)
            try:
                bus = Bus(nc, "generator")
                failed, _ = await bus.js_publish(subjects.query(sid), Query(
                    session_id=sid, content="failed"), session_id=sid)
                await QueryErrors(bus.js).keep(Reply(
                    session_id=sid, query_id=failed.message_id, error="the model failed",
                    error_code="provider_error"), "failed")
            finally:
                await nc.close()
            retry = await http.post(f"/api/sessions/{sid}/retry")
    finally:
        system.stop()
    # Taken and queued (no generator runs to answer it), not refused.
    assert retry.status_code == 504, retry.text
    assert retry.json()["error"]["code"] == "reply_timeout"


async def test_two_retries_asked_at_once_of_one_answer_replace_it_once(
        private_nats: NatsServer, stub: str) -> None:
    """Two tabs retry the same answer within milliseconds: both gateways read
    the session before either retry is queued, so both pass their checks and
    both queue a retry naming the answer it replaces. The generator takes
    them one at a time under the session's lock: the first replaces the
    answer, the second finds another in its place and is refused."""
    system = System(private_nats.url, stub, services=("generator", "gateway")).start()
    try:
        async with system.http() as http:
            # Both are queued before either is answered.
            sid, answer_id = await answered_then_no_generator(http, system, "hello")
            replies = await two_retries_replied(private_nats.url, sid, answer_id, system)
            messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
    finally:
        system.stop()
    taken, refused = replies
    assert taken.error is None and taken.reply == "Echo: hello (turn 1)"
    assert refused.error_code == "retry_outdated" and "replaced" in (refused.error or "")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["query_id"] == taken.query_id


async def two_retries_replied(nats_url: str, sid: str, answer_id: str,
                              system: System) -> list[Reply]:
    """Queue two retries of `answer_id` as two gateways would, start the
    generator, and return the two replies in the order they came."""
    nc = await nats.connect(nats_url)
    try:
        replies: asyncio.Queue[Reply] = asyncio.Queue()

        async def on_reply(msg: Msg) -> None:
            await replies.put(decode(msg.data, Reply, msg.subject).payload)

        await nc.subscribe(subjects.reply(sid), cb=on_reply)
        bus = Bus(nc, "gateway")
        for _ in range(2):
            await bus.js_publish(subjects.query(sid), Query(
                session_id=sid, content="hello", retry=True, replacing=answer_id),
                session_id=sid)
        system["generator"].start()
        return [await asyncio.wait_for(replies.get(), 30) for _ in range(2)]
    finally:
        await nc.close()
