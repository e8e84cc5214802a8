"""The generator's `MAX_CONCURRENT_SESSIONS` slots, with the generator built in
this process on a server of the test's own and the Ollama stand-in."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg

from schemas import subjects
from schemas.history import ChatMessage
from schemas.messages import CompactionRequest, Query
from schemas.session import SessionRecord
from services.generator.service import build
from services.generator.settings import GeneratorSettings
from services.generator.slots import Slots
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore
from services.shared.jetstream import ensure_layout
from services.shared.sessions import SessionStore
from tests.events import eventually, watching
from tests.nats_server import NatsServer
from tests.stub_server import running_stub


def test_a_sessions_queries_share_one_slot() -> None:
    slots = Slots(3)
    first, second, third, other = object(), object(), object(), object()
    for holder in (first, second, third):
        slots.take(holder)  # delivered: the session is not known yet
    assert slots.free() == 0
    assert not slots.join(first, "s")  # the session's first: its slot
    assert slots.join(second, "s") and slots.join(third, "s")  # queued behind it
    assert slots.free() == 2
    slots.take(other)
    assert not slots.join(other, "t") and slots.free() == 1
    assert not slots.give_back(first)  # answered: the next goes on in the slot
    assert not slots.give_back(first)  # given back already
    assert not slots.give_back(second) and slots.give_back(third)
    assert slots.free() == 2


def test_a_holder_of_no_session_gives_its_own_slot_back() -> None:
    slots, compaction = Slots(1), object()
    slots.take(compaction)
    assert slots.free() == 0 and slots.holds(compaction)
    assert slots.give_back(compaction) and slots.free() == 1
    assert not slots.holds(compaction)


async def test_a_query_gives_its_slot_back_as_its_reply_goes_out(
        private_nats: NatsServer, stub_url: str) -> None:
    """The lock's release comes after the reply; with every slot taken, the
    session's next query must not wait for that release to be pulled."""
    nc = await nats.connect(private_nats.url)
    bus = Bus(nc, "generator")
    await ensure_layout(bus.js)
    generator = await build(bus, GeneratorSettings(
        ollama_host=stub_url, model="stub-model", max_concurrent_sessions=1))
    await generator.start()
    try:
        sessions = await SessionStore.open(bus.js)
        await sessions.create(SessionRecord(session_id="slots"))
        free_at_reply: asyncio.Queue[int] = asyncio.Queue()

        async def on_reply(_msg: Msg) -> None:
            free_at_reply.put_nowait(generator.status()["free_slots"])

        await nc.subscribe(subjects.reply("slots"), cb=on_reply)
        for question in ("first", "second"):
            await bus.js_publish(subjects.query("slots"),
                                 Query(session_id="slots", content=question),
                                 session_id="slots")
            assert await asyncio.wait_for(free_at_reply.get(), 10) == 1
    finally:
        await generator.stop()
        await nc.close()


async def test_compaction_requests_in_a_burst_run_one_at_a_time(
        private_nats: NatsServer) -> None:
    """Compactions share the query slots but keep at most one beyond them: a
    burst of requests must not fill every slot while the queries' pull requests
    still stand."""
    with running_stub("--model-latency", "summariser=300") as stub:
        nc = await nats.connect(private_nats.url)
        bus = Bus(nc, "generator")
        await ensure_layout(bus.js)
        generator = await build(bus, GeneratorSettings(
            ollama_host=stub, model="stub-model", compaction_model="summariser",
            compaction_tail_turns=1, max_concurrent_sessions=2))
        sessions, history = (await SessionStore.open(bus.js)), HistoryStore(bus.js)
        sids = [f"burst{n}" for n in range(3)]
        for sid in sids:
            await sessions.create(SessionRecord(session_id=sid))
            view = await history.read(sid)
            for turn in range(3):
                view = await history.append(sid, view, [
                    ChatMessage(role="user", content=f"question {turn} " + "words " * 40),
                    ChatMessage(role="assistant", content=f"answer {turn} " + "words " * 40)])
        await generator.start()
        try:
            async with watching(private_nats.url, subjects.COMPACTION_EVENT,
                                subjects.COMPACTION_RESULT) as watcher:
                for sid in sids:
                    await bus.js_publish(subjects.COMPACTION_REQUEST,
                                         CompactionRequest(session_id=sid, auto=False),
                                         session_id=sid)
                await watcher.wait_until(
                    lambda: len(watcher.payloads("compaction.result")) == len(sids))
        finally:
            await generator.stop()
            await nc.close()
    running, most = 0, 0
    for event in watcher.events:
        if event["message_type"] == "compaction.event" and event["payload"]["event"] != "started":
            continue  # a running compaction's progress
        running += 1 if event["message_type"] == "compaction.event" else -1
        most = max(most, running)
    assert most == 1
    assert {r["status"] for r in watcher.payloads("compaction.result")} == {"completed"}


async def test_one_sessions_backlog_leaves_room_for_other_sessions(
        private_nats: NatsServer) -> None:
    """Queries waiting behind their own session's earlier query share one
    slot: with two slots and four queries queued on a session whose answers
    are slow, another session's query is still pulled and answered at once,
    not after the backlog."""
    with running_stub("--model-latency", "slow=30000") as stub:
        nc = await nats.connect(private_nats.url)
        bus = Bus(nc, "generator")
        await ensure_layout(bus.js)
        generator = await build(bus, GeneratorSettings(
            ollama_host=stub, model="stub-model", max_concurrent_sessions=2))
        sessions = await SessionStore.open(bus.js)
        await sessions.create(SessionRecord(session_id="backlog", model="slow"))
        await sessions.create(SessionRecord(session_id="other"))
        answered: asyncio.Queue[str] = asyncio.Queue()

        async def on_reply(msg: Msg) -> None:
            answered.put_nowait(msg.subject)

        for sid in ("backlog", "other"):
            await nc.subscribe(subjects.reply(sid), cb=on_reply)
        await generator.start()
        try:
            for n in range(4):
                await bus.js_publish(subjects.query("backlog"),
                                     Query(session_id="backlog", content=f"q{n}"),
                                     session_id="backlog")
            await bus.js_publish(subjects.query("other"),
                                 Query(session_id="other", content="hi"), session_id="other")
            # Well within the first slow answer (30 s).
            assert await asyncio.wait_for(answered.get(), 25) == subjects.reply("other")
            # The backlog in hand takes one slot; the other one is free again.
            # Its slot is given back a moment after its reply.
            await eventually(lambda: generator.status()["free_slots"] == 1, "one slot free")
        finally:
            await generator.stop()
            await nc.close()
