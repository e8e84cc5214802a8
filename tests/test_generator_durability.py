"""Many sessions at once, each in order; two generator processes; and no
query lost or answered twice when a generator is missing, killed or frozen.

Each test runs its own processes against its own nats-server, so work
queues and durable consumers start empty."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import Query
from services.shared.bus import Bus, round_trip
from tests.events import (
    Watcher,
    consumer_caught_up,
    server_sent_events,
    transitions,
    turns_finished,
    watching,
)
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, running_stub
from tests.system import System
from tests.test_generator_turns import TURN

STATES = f"{subjects.STATE_PREFIX}.*"


@pytest.fixture
def stub() -> Iterator[str]:
    with running_stub() as url:
        yield url


@pytest.fixture
def system(private_nats: NatsServer, stub: str) -> Iterator[System]:
    system = System(private_nats.url, stub, services=("gateway",))
    yield system
    system.stop()


@pytest.fixture
async def http(system: System) -> AsyncIterator[httpx.AsyncClient]:
    async with system.http(timeout=60) as client:
        yield client


def add_generator(system: System, name: str) -> None:
    system.add(name, "services.generator", {"GENERATOR_ID": name}).start()


def launch(system: System, *generators: str) -> None:
    """The gateway, then one generator process per name."""
    system.start()
    for name in generators:
        add_generator(system, name)


async def create(http: httpx.AsyncClient) -> str:
    return str((await http.post("/api/sessions", json={})).json()["session_id"])


async def say(http: httpx.AsyncClient, sid: str, content: str) -> httpx.Response:
    return await http.post(f"/api/sessions/{sid}/messages", json={"content": content})


async def in_order(http: httpx.AsyncClient, nats_url: str, sid: str,
                   contents: list[str]) -> list[str]:
    """Send the queries without waiting for answers, each once the one before is
    in the queue (so their order is known); return the replies."""
    nc = await nats.connect(nats_url)
    queued: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await nc.subscribe(subjects.query(sid), cb=queued.put)
    await round_trip(nc)  # subscribed at the server before any query is sent
    try:
        tasks = []
        for content in contents:
            tasks.append(asyncio.create_task(say(http, sid, content)))
            await asyncio.wait_for(queued.get(), 10)
        return [str((await task).json().get("reply")) for task in tasks]
    finally:
        await sub.unsubscribe()
        await nc.close()


def max_concurrent_generations(watcher: Watcher) -> int:
    active: set[str] = set()
    peak = 0
    for event in watcher.payloads("generator.state"):
        if event["action"] == "start_generation":
            active.add(event["session_id"])
        elif event["action"] == "reset":
            active.discard(event["session_id"])
        peak = max(peak, len(active))
    return peak


async def history(http: httpx.AsyncClient, sid: str) -> list[tuple[str, str]]:
    messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
    return [(m["role"], m["content"]) for m in messages]


async def test_one_process_answers_many_sessions_at_once(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    # The model is held: no answer can end before eight have begun, however
    # slowly the queries come in, so eight at once is forced, not raced for.
    await configure_stub(stub, held_models=["stub-model"])
    launch(system, "gen-a")
    sids = [await create(http) for _ in range(16)]
    async with watching(private_nats.url, STATES) as watcher:
        asked = [asyncio.create_task(say(http, sid, "hello")) for sid in sids]
        await watcher.wait_until(lambda: max_concurrent_generations(watcher) >= 8, 30)
        await configure_stub(stub, held_models=[])
        replies = await asyncio.gather(*asked)
    assert all(r.json()["reply"] == "Echo: hello (turn 1)" for r in replies)
    assert max_concurrent_generations(watcher) >= 8


async def test_queries_of_one_session_are_answered_one_after_the_other_in_order(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    await configure_stub(stub, model_latency={"stub-model": 150})
    launch(system, "gen-a")
    sid = await create(http)
    async with watching(private_nats.url, STATES) as watcher:
        replies = await in_order(http, private_nats.url, sid, ["one", "two", "three", "four"])
        await turns_finished(watcher, sid, 4)
    assert replies == [f"Echo: {w} (turn {i})" for i, w in
                       enumerate(["one", "two", "three", "four"], 1)]
    assert transitions(watcher, sid) == TURN * 4
    assert [c for r, c in await history(http, sid) if r == "user"] == [
        "one", "two", "three", "four"]


async def test_two_generator_processes_share_sessions_and_never_interleave_one(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    await configure_stub(stub, model_latency={"stub-model": 100})
    launch(system, "gen-a", "gen-b")
    sids = [await create(http) for _ in range(10)]
    words = ["alpha", "beta", "gamma"]
    async with watching(private_nats.url, STATES) as watcher:
        results = await asyncio.gather(*(in_order(http, private_nats.url, sid, words)
                                         for sid in sids))
        for sid in sids:
            await turns_finished(watcher, sid, 3)
    expected = [f"Echo: {w} (turn {i})" for i, w in enumerate(words, 1)]
    assert all(replies == expected for replies in results)
    for sid in sids:
        assert transitions(watcher, sid) == TURN * 3
    workers = {e["generator_id"] for e in watcher.payloads("generator.state")
               if e["action"] == "start_generation"}
    assert workers == {"gen-a", "gen-b"}


async def test_a_query_accepted_while_no_generator_runs_is_answered_when_one_starts(
    system: System, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    system.start()  # gateway only
    sid = await create(http)
    nc = await nats.connect(private_nats.url)
    try:
        queued = await nc.subscribe(subjects.query(sid))
        await round_trip(nc)
        pending = asyncio.create_task(say(http, sid, "anyone?"))
        await queued.next_msg(timeout=10)  # accepted: in the stream, with nobody to answer
    finally:
        await nc.close()
    assert not pending.done()
    add_generator(system, "gen-late")
    reply = await asyncio.wait_for(pending, 30)
    assert reply.json()["reply"] == "Echo: anyone? (turn 1)"
    assert await history(http, sid) == [("user", "anyone?"),
                                        ("assistant", "Echo: anyone? (turn 1)")]


async def test_a_generator_killed_mid_answer_loses_nothing_and_doubles_nothing(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    launch(system, "gen-a")
    sid = await create(http)
    await say(http, sid, "warm up")
    # Held until gen-a is dead: killed with its model call under way, never after.
    await configure_stub(stub, held_models=["stub-model"])
    async with watching(private_nats.url, STATES) as watcher:
        pending = asyncio.create_task(say(http, sid, "!long 600 tell me a story"))
        await watcher.wait_for(lambda e: e["payload"].get("to_state") == "generating"
                               and e["payload"]["session_id"] == sid)
        system["gen-a"].kill()
    assert not pending.done()
    await configure_stub(stub, held_models=[])
    add_generator(system, "gen-b")
    reply = (await asyncio.wait_for(pending, 60)).json()
    assert reply["reply"].startswith("Echo: !long 600 tell me a story (turn 2)")
    stored = await history(http, sid)
    assert [r for r, _ in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[2] == ("user", "!long 600 tell me a story")
    assert stored[3][1] == reply["reply"]


async def test_a_frozen_holder_past_its_lease_cannot_write(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    # Held until the holder is frozen: it is frozen mid-answer, never after.
    await configure_stub(stub, held_models=["stub-model"])
    launch(system, "gen-a", "gen-b")
    sid = await create(http)
    async with watching(private_nats.url, STATES) as watcher:
        pending = asyncio.create_task(say(http, sid, "freeze me"))
        started = await watcher.wait_for(lambda e: e["payload"].get("action") == "start_generation")
    frozen_name = started["payload"]["generator_id"]
    frozen = system[frozen_name]
    frozen.signal(signal.SIGSTOP)
    await configure_stub(stub, held_models=[])
    try:
        reply = (await asyncio.wait_for(pending, 60)).json()
    finally:
        frozen.signal(signal.SIGCONT)
    assert reply["reply"] == "Echo: freeze me (turn 1)"
    await asyncio.to_thread(frozen.wait_for, "stale_history_write_rejected", 20.0)
    # The woken holder's query is done with: nothing more can be written.
    await consumer_caught_up(private_nats.url, subjects.QUERIES_STREAM, "generator")
    assert await history(http, sid) == [("user", "freeze me"),
                                        ("assistant", "Echo: freeze me (turn 1)")]


async def test_a_retried_publish_of_a_query_is_stored_and_answered_once(
    system: System, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    launch(system, "gen-a")
    sid = await create(http)
    nc = await nats.connect(private_nats.url)
    bus = Bus(nc, "gateway")
    replies = await nc.subscribe(subjects.reply(sid))
    query = Query(session_id=sid, content="only once")
    _, first = await bus.js_publish(subjects.query(sid), query, message_id="fixed-id")
    _, second = await bus.js_publish(subjects.query(sid), query, message_id="fixed-id")
    assert not first.duplicate and second.duplicate
    await replies.next_msg(timeout=15)
    # Every delivery of the query settled, each reply published before its
    # acknowledgement: a second answer would be here by now.
    await consumer_caught_up(private_nats.url, subjects.QUERIES_STREAM, "generator")
    await round_trip(nc)
    assert replies.pending_msgs == 0
    await nc.drain()
    assert await history(http, sid) == [("user", "only once"),
                                        ("assistant", "Echo: only once (turn 1)")]


async def test_a_streamed_answer_cut_by_a_killed_generator_restarts_cleanly(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    # The answer stops after its first piece until gen-a is dead: cut mid-stream, never after.
    await configure_stub(stub, paused_models=["stub-model"])
    launch(system, "gen-a")
    sid = await create(http)
    events: list[tuple[str, dict[str, object]]] = []
    killed = False
    async with http.stream("POST", f"/api/sessions/{sid}/messages",
                           json={"content": "!long 600 stream it"},
                           headers={"Accept": "text/event-stream"}) as response:
        async for name, data in server_sent_events(response):
            events.append((name, data))
            if name == "token" and not killed:
                system["gen-a"].kill()
                killed = True
                await configure_stub(stub, paused_models=[])
                add_generator(system, "gen-b")
    names = [n for n, _ in events]
    assert names.count("restart") == 1 and names[-1] == "done"
    after_restart = events[names.index("restart") + 1:-1]
    streamed = "".join(str(d["text"]) for _, d in after_restart)
    assert streamed == events[-1][1]["reply"]
    assert [r for r, _ in await history(http, sid)] == ["user", "assistant"]


async def test_a_turn_cut_short_at_shutdown_is_handed_back_at_once(
    system: System, stub: str, http: httpx.AsyncClient, private_nats: NatsServer
) -> None:
    """SIGTERM gives a turn longer than the shutdown allows a few seconds, then
    cancels it: its query must be offered again at once, not after a whole ack
    wait (two minutes here) before another generator may answer it."""
    system.env["QUERY_ACK_WAIT_S"] = "120"
    await configure_stub(stub, model_latency={"stub-model": 60_000})
    launch(system, "gen-a")
    sid = await create(http)
    async with watching(private_nats.url, STATES) as watcher:
        pending = asyncio.create_task(say(http, sid, "a long one"))
        await watcher.wait_for(lambda e: e["payload"].get("to_state") == "generating"
                               and e["payload"]["session_id"] == sid)
    assert await asyncio.to_thread(system["gen-a"].stop) == 0
    nc = await nats.connect(private_nats.url)
    try:
        queries = await nc.jetstream().pull_subscribe_bind("generator", subjects.QUERIES_STREAM)
        [again] = await queries.fetch(1, timeout=10)  # well within the ack wait
        assert again.metadata.num_delivered == 2
        await again.nak()  # for the next generator
    finally:
        await nc.close()
    await configure_stub(stub, model_latency={"stub-model": 0})
    add_generator(system, "gen-b")
    reply = (await asyncio.wait_for(pending, 60)).json()
    assert reply["reply"] == "Echo: a long one (turn 1)"
    assert await history(http, sid) == [("user", "a long one"),
                                        ("assistant", "Echo: a long one (turn 1)")]
