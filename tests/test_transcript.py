"""The transcript beside the context, on real processes: compaction changes
what the model is sent, never what was said; paging; a generator killed
mid-compaction; delete purges everything."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from schemas import subjects
from services.shared.bus import round_trip
from services.tools.recall import run_recall
from tests.compaction.rig import (
    EVENTS,
    compaction_stub,
    create,
    next_result,
    publish_request,
    session,
)
from tests.events import watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub
from tests.system import System

# A window large enough that no compaction happens unless asked for.
ROOMY = {"NUM_CTX": "16384", "COMPACTION_TAIL_TURNS": "2", "COMPACTION_MODEL": "summariser"}
Start = Callable[..., tuple[System, httpx.AsyncClient]]


@pytest.fixture
def stub() -> Iterator[str]:
    with compaction_stub() as url:  # its summariser takes 1.5 s
        yield url


@pytest.fixture
async def start(private_nats: NatsServer, stub: str) -> AsyncIterator[Start]:
    systems: list[System] = []
    clients: list[httpx.AsyncClient] = []

    def starter(*services: str, **env: str) -> tuple[System, httpx.AsyncClient]:
        systems.append(System(private_nats.url, stub, {**ROOMY, **env},
                              services=services).start())
        clients.append(systems[-1].http(timeout=60))
        return systems[-1], clients[-1]

    yield starter
    for client in clients:
        await client.aclose()
    for system in systems:
        system.stop()


async def turns(http: httpx.AsyncClient, sid: str, first: int, last: int) -> None:
    for i in range(first, last + 1):
        response = await http.post(f"/api/sessions/{sid}/messages",
                                   json={"content": f"question {i} !long 60"})
        assert response.status_code == 200, response.text


async def transcript(http: httpx.AsyncClient, sid: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Every item, page by page."""
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params = {"limit": str(limit), **({"after": cursor} if cursor else {})}
        response = await http.get(f"/api/sessions/{sid}/transcript", params=params)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["session_id"] == sid
        items += body["items"]
        cursor = body["next"]
        if cursor is None:
            return items


async def transcript_backwards(http: httpx.AsyncClient, sid: str,
                               limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor: str | None = "end"
    while cursor is not None:
        response = await http.get(f"/api/sessions/{sid}/transcript",
                                  params={"before": cursor, "limit": str(limit)})
        assert response.status_code == 200, response.text
        items = response.json()["items"] + items
        cursor = response.json()["previous"]
    return items


async def compact(nats_url: str, http: httpx.AsyncClient, sid: str, auto: bool,
                  count: int) -> dict[str, Any]:
    async with watching(nats_url, *EVENTS) as watcher:
        if auto:
            await publish_request(nats_url, sid, "gentle")
        else:
            assert (await http.post(f"/api/sessions/{sid}/compact")).status_code == 202
        result = await next_result(watcher, sid)
    assert result["status"] == "completed", result
    return result


async def test_the_transcript_keeps_every_message_and_a_marker_per_compaction(
    private_nats: NatsServer, start: Start
) -> None:
    _, http = start("generator", "gateway")
    sid = await create(http, auto_compact=False)
    results = []
    for block, auto in enumerate((False, True, False)):
        await turns(http, sid, block * 10 + 1, block * 10 + 10)
        results.append(await compact(private_nats.url, http, sid, auto, block + 1))
    items = await transcript(http, sid, limit=7)

    messages = [i for i in items if i["kind"] == "message"]
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        f"question {i} !long 60" for i in range(1, 31)]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 30
    markers = [i for i in items if i["kind"] == "compaction"]
    assert [items.index(m) for m in markers] == [20, 41, 62]  # after turns 10, 20, 30
    assert [m["auto"] for m in markers] == [False, True, False]
    for marker, result in zip(markers, results, strict=True):
        assert marker["summary"] == result["summary"] and marker["level"] == result["level"]
        assert (marker["tokens_before"], marker["tokens_after"]) == (
            result["tokens_before"], result["tokens_after"])
        assert marker["at"] is not None

    context = await session(http, sid)
    assert context["summary"] == markers[-1]["summary"] and context["compactions"] == 3
    tail = [(m["role"], m["content"]) for m in messages[-4:]]  # the last two turns
    assert [(m["role"], m["content"]) for m in context["messages"]] == tail
    assert markers[-1]["kept_messages"] == 4


async def test_paging_returns_every_item_exactly_once(
    private_nats: NatsServer, start: Start
) -> None:
    _, http = start("generator", "gateway")
    sid = await create(http, auto_compact=False)
    await turns(http, sid, 1, 5)
    await compact(private_nats.url, http, sid, False, 1)
    await turns(http, sid, 6, 8)
    whole = await transcript(http, sid, limit=1000)
    assert len(whole) == 8 * 2 + 1
    for limit in (1, 2, 3, 16, 17):
        paged = await transcript(http, sid, limit=limit)
        assert paged == whole
        assert len({i["position"] for i in paged}) == len(paged)
    for limit in (1, 3, 17):  # backwards, as the page scrolls up
        assert await transcript_backwards(http, sid, limit) == whole
    markers = (await http.get(f"/api/sessions/{sid}/transcript",
                              params={"kind": "compaction"})).json()["items"]
    assert markers == [i for i in whole if i["kind"] == "compaction"]
    newest = (await http.get(f"/api/sessions/{sid}/transcript",
                             params={"kind": "compaction", "before": "end", "limit": "3"})).json()
    assert newest["items"] == markers and newest["previous"] is None
    newest = (await http.get(f"/api/sessions/{sid}/transcript",
                             params={"kind": "message", "before": "end", "limit": "3"})).json()
    assert newest["items"] == [i for i in whole if i["kind"] == "message"][-3:]
    default = (await http.get(f"/api/sessions/{sid}/transcript")).json()
    assert default["items"] == whole and default["next"] is None
    exported = await http.get(f"/api/sessions/{sid}/export", params={"format": "json"})
    assert exported.json()["items"] == whole
    assert "attachment" in exported.headers["content-disposition"]
    # Sent as it is read, so a long transcript never sits whole in the gateway's memory.
    assert "content-length" not in exported.headers
    text = (await http.get(f"/api/sessions/{sid}/export")).text
    assert text.index("question 5 !long 60") < text.index("compacted · manual") < text.index(
        "question 6 !long 60")
    assert (await http.get(f"/api/sessions/{sid}/export",
                           params={"format": "pdf"})).status_code == 400
    huge = "9" * 5000
    for bad in ({"limit": "0"}, {"limit": "1001"}, {"after": "x"}, {"kind": "other"},
                {"before": "end", "after": "1-0"}, {"limit": huge}, {"after": f"{huge}-0"},
                {"before": f"{2**64}-0"}):
        response = await http.get(f"/api/sessions/{sid}/transcript", params=bad)
        assert response.status_code == 400, bad
        assert response.json()["error"]["code"] == "invalid_field"


async def test_a_generator_killed_during_a_compaction_loses_nothing_from_either_view(
    private_nats: NatsServer, stub: str, start: Start
) -> None:
    system, http = start("gateway")
    system.add("gen-a", "services.generator", {"GENERATOR_ID": "gen-a"}).start()
    sid = await create(http, auto_compact=False)
    await turns(http, sid, 1, 6)
    before = await transcript(http, sid)
    context_before = (await session(http, sid))["messages"]
    async with watching(private_nats.url, *EVENTS) as watcher:
        await configure_stub(stub, held_models=["summariser"])  # it is writing when killed
        await http.post(f"/api/sessions/{sid}/compact")
        await watcher.wait_for(lambda e: e["payload"].get("event") == "started")
        system["gen-a"].kill()
        assert (await session(http, sid))["messages"] == context_before
        assert await transcript(http, sid) == before
        await configure_stub(stub, held_models=[])
        system.add("gen-b", "services.generator", {"GENERATOR_ID": "gen-b"}).start()
        result = await next_result(watcher, sid)
    assert result["status"] == "completed", result
    after = await transcript(http, sid)
    assert after[:-1] == before and after[-1]["kind"] == "compaction"
    context = await session(http, sid)
    assert context["summary"] == after[-1]["summary"]
    assert context["messages"] == context_before[-4:]


async def test_delete_purges_everything_and_answers_what_is_queued(
    private_nats: NatsServer, start: Start
) -> None:
    system, http = start("gateway")
    generator = system.add("gen-a", "services.generator", {"GENERATOR_ID": "gen-a"}).start()
    sid = await create(http, auto_compact=False)
    await turns(http, sid, 1, 4)
    await compact(private_nats.url, http, sid, False, 1)
    generator.stop()
    nc = await nats.connect(private_nats.url)
    js = nc.jetstream()
    seen: asyncio.Queue[Msg] = asyncio.Queue()
    await nc.subscribe(subjects.query(sid), cb=seen.put)
    await round_trip(nc)  # the server has the subscription before the query is sent
    queued = asyncio.create_task(http.post(f"/api/sessions/{sid}/messages",
                                           json={"content": "still waiting"}))
    try:
        await asyncio.wait_for(seen.get(), 10)  # in the queue, and nobody to answer it
        await round_trip(nc)
        assert (await http.delete(f"/api/sessions/{sid}")).status_code == 204
        answer = await asyncio.wait_for(queued, 20)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_session"
        for stream, subject in ((subjects.HISTORY_STREAM, subjects.history(sid)),
                                (subjects.QUERIES_STREAM, subjects.query(sid)),
                                (subjects.STATE_STREAM, subjects.state(sid))):
            assert await _count(js, stream, subject) == 0, stream
        for bucket in (subjects.SESSIONS_BUCKET, subjects.LOCKS_BUCKET,
                       subjects.COMPACTIONS_RUNNING_BUCKET):
            assert not await _holds(js, bucket, sid), bucket
    finally:
        await nc.close()
    for method, path in (("GET", ""), ("GET", "/transcript"), ("GET", "/export"),
                         ("DELETE", ""), ("POST", "/compact")):
        response = await http.request(method, f"/api/sessions/{sid}{path}")
        assert response.status_code == 404, (method, path)
    posted = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hello?"})
    assert posted.status_code == 404


async def history_entries(nats_url: str, sid: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        return await _count(nc.jetstream(), subjects.HISTORY_STREAM, subjects.history(sid))
    finally:
        await nc.close()


async def test_a_session_deleted_during_its_first_answer_is_not_written_again(
    private_nats: NatsServer, stub: str, start: Start
) -> None:
    """The delete purged an empty history subject, which is just what a first
    turn's append expects: the turn was stored after the delete, for good,
    and a second delete answered 204."""
    _, http = start("generator", "gateway")
    sid = await create(http, auto_compact=False)
    async with watching(private_nats.url, f"{subjects.STATE_PREFIX}.*") as watcher:
        await configure_stub(stub, held_models=["stub-model"])
        asked = asyncio.create_task(http.post(f"/api/sessions/{sid}/messages",
                                              json={"content": "hello"}))
        await watcher.wait_for(lambda e: e["payload"].get("to_state") == "generating")
        assert (await http.delete(f"/api/sessions/{sid}")).status_code == 204
        await configure_stub(stub, held_models=[])
        answer = await asked
        await watcher.wait_for(lambda e: e["payload"].get("to_state") == "idle")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_session"
    assert await history_entries(private_nats.url, sid) == 0
    assert (await http.delete(f"/api/sessions/{sid}")).status_code == 404


async def test_a_compaction_in_flight_when_its_session_is_deleted_ends_skipped(
    private_nats: NatsServer, start: Start
) -> None:
    _, http = start("generator", "gateway")
    sid = await create(http, auto_compact=False)
    await turns(http, sid, 1, 4)
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        await watcher.wait_for(lambda e: e["payload"].get("event") == "started")
        assert (await http.delete(f"/api/sessions/{sid}")).status_code == 204
        result = await next_result(watcher, sid)
    assert result["status"] == "skipped" and "deleted" in result["error"], result
    assert await history_entries(private_nats.url, sid) == 0
    assert (await http.get(f"/api/sessions/{sid}/transcript")).status_code == 404


async def test_a_delete_cut_short_after_the_record_went_is_finished_by_the_next(
    private_nats: NatsServer, start: Start
) -> None:
    _, http = start("generator", "gateway")
    sid = await create(http, auto_compact=False)
    await turns(http, sid, 1, 2)
    nc = await nats.connect(private_nats.url)
    js = nc.jetstream()
    try:
        # What a delete leaves when NATS goes away right after its first step.
        await (await js.key_value(subjects.SESSIONS_BUCKET)).purge(sid)
        assert await _count(js, subjects.HISTORY_STREAM, subjects.history(sid)) > 0
        assert (await http.delete(f"/api/sessions/{sid}")).status_code == 204
        assert await _count(js, subjects.HISTORY_STREAM, subjects.history(sid)) == 0
    finally:
        await nc.close()
    assert (await http.delete(f"/api/sessions/{sid}")).status_code == 404
    assert (await http.delete(f"/api/sessions/{uuid.uuid4().hex}")).status_code == 404


async def _holds(js: JetStreamContext, bucket: str, key: str) -> bool:
    """Whether the bucket has a value under the key (a purge leaves only a marker)."""
    try:
        await (await js.key_value(bucket)).get(key)
    except KeyNotFoundError:
        return False
    return True


async def _count(js: JetStreamContext, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


async def test_recall_finds_what_only_the_compacted_part_holds_in_its_own_session(
    private_nats: NatsServer, start: Start
) -> None:
    _, http = start("tools", "generator", "gateway")
    other = await create(http, auto_compact=False)
    await http.post(f"/api/sessions/{other}/messages", json={"content": "my locker code is 9999"})
    sid = await create(http, auto_compact=False)
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "hello there"})
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "my locker code is 4711"})
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "储物柜在三楼。"})
    await turns(http, sid, 3, 6)
    await compact(private_nats.url, http, sid, False, 1)
    context = await session(http, sid)
    assert "4711" not in f"{context['summary']} {context['messages']}"  # compacted away

    reply = await http.post(f"/api/sessions/{sid}/messages", json={
        "content": '!tool recall {"query": "Locker CODE"}'})
    assert reply.status_code == 200, reply.text
    answer = reply.json()["reply"]
    assert "my locker code is 4711" in answer and "9999" not in answer
    stored = (await session(http, sid))["messages"]
    assert [m["role"] for m in stored[-4:]] == ["user", "assistant", "tool", "assistant"]
    assert stored[-2]["tool_name"] == "recall"
    # A word of a script without spaces, and the text given back as it was
    # written, not as \\u escapes.
    reply = await http.post(f"/api/sessions/{sid}/messages", json={
        "content": '!tool recall {"query": "三楼"}'})
    assert "储物柜在三楼。" in reply.json()["reply"]


async def test_recall_without_a_session_or_with_bad_arguments_says_why(nc: NATS) -> None:
    js = nc.jetstream()
    assert (await run_recall(js, None, {"query": "x"})).error == (
        "recall is only available inside a session")
    for bad in ({}, {"query": " "}, {"query": "x", "limit": 0}, {"query": "x", "limit": True}):
        outcome = await run_recall(js, "some-session", bad)
        assert outcome.error is not None and outcome.error.startswith("bad arguments"), bad


async def test_retention_drops_old_turns_at_a_compaction_but_keeps_the_context(
    private_nats: NatsServer, start: Start
) -> None:
    # Every entry is older than a millisecond by the time the compaction ends.
    _, http = start("generator", "gateway", TRANSCRIPT_MAX_AGE="0.001")
    sid = await create(http, auto_compact=False)
    await turns(http, sid, 1, 5)
    await compact(private_nats.url, http, sid, False, 1)
    items = await transcript(http, sid)
    assert [i["kind"] for i in items] == ["message"] * 4 + ["compaction"]
    assert [i["content"] for i in items[:4:2]] == ["question 4 !long 60", "question 5 !long 60"]
    context = await session(http, sid)
    assert context["summary"] == items[-1]["summary"]
    assert [m["content"] for m in context["messages"]] == [i["content"] for i in items[:4]]
