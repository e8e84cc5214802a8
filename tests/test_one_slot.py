"""A one-slot model server shared by answers and a long summary: the summary
goes in pieces, and the next piece is not sent while an answer waits, so an
answer waits for the piece under way at most, never the whole summary.

Real processes: a nats-server, the generator built in this process, and the
Ollama stand-in at `--parallel 1`, whose `/_stub/slots` log tells in which
order requests arrived, got the slot and sent their first chunk."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import nats
from nats.aio.msg import Msg

from schemas import subjects
from schemas.history import ChatMessage
from schemas.messages import CompactionRequest, Query
from schemas.session import SessionRecord
from services.generator.service import build
from services.generator.settings import GeneratorSettings
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore
from services.shared.jetstream import ensure_layout
from services.shared.sessions import SessionStore
from tests.events import eventually, watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, running_stub

SID = "one-slot"


async def stub_log(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as http:
        answer: dict[str, Any] = (await http.get(f"{url}/_stub/slots")).json()
    return [entry for entry in answer["log"] if entry["model"] == "stub-model:latest"]


def arrived(log: list[dict[str, Any]], kind: str) -> int:
    return sum(1 for entry in log if entry["event"] == "arrived" and entry["kind"] == kind)


def sent_while_the_answer_waited(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summary requests that reached the server between the answer's arrival
    and its first chunk: each is a piece the answer may have waited behind."""
    events = [(entry["event"], entry["kind"]) for entry in log]
    came = events.index(("arrived", "answer"))
    first = events.index(("first_chunk", "answer"))
    return [log[i] for i in range(came, first) if events[i] == ("arrived", "summary")]


async def seed_long_history(bus: Bus) -> None:
    await (await SessionStore.open(bus.js)).create(SessionRecord(session_id=SID))
    history = HistoryStore(bus.js)
    view = await history.read(SID)
    for turn in range(12):
        view = await history.append(SID, view, [
            ChatMessage(role="user", content=f"question {turn} " + "words " * 60),
            ChatMessage(role="assistant", content=f"answer {turn} " + "words " * 60)])


async def test_an_answer_during_a_long_summary_waits_for_one_piece_at_most(
        private_nats: NatsServer) -> None:
    # Every call takes a while before its first chunk, so a piece sent as soon
    # as the previous one ended would reach the server while the answer waits.
    with running_stub("--parallel", "1", "--model-latency", "stub-model=300") as url:
        nc = await nats.connect(private_nats.url)
        bus = Bus(nc, "generator")
        await ensure_layout(bus.js)
        # The model that answers writes the summaries too, in a window that
        # takes several pieces for this history.
        generator = await build(bus, GeneratorSettings(
            ollama_host=url, model="stub-model", compaction_num_ctx=2048,
            compaction_tail_turns=1, max_concurrent_sessions=2))
        await seed_long_history(bus)
        replies: asyncio.Queue[Msg] = asyncio.Queue()
        await nc.subscribe(subjects.reply(SID), cb=replies.put)
        await generator.start()
        try:
            async with watching(private_nats.url, subjects.COMPACTION_RESULT) as watcher:
                # Held at the server: the first piece and then the answer queue
                # up there, so the answer surely comes during the summary.
                await configure_stub(url, held_models=["stub-model"])
                await bus.js_publish(subjects.COMPACTION_REQUEST,
                                     CompactionRequest(session_id=SID, auto=False),
                                     session_id=SID)

                async def summary_came() -> bool:
                    return arrived(await stub_log(url), "summary") == 1

                await eventually(summary_came, "the first piece at the server")
                await bus.js_publish(subjects.query(SID),
                                     Query(session_id=SID, content="meanwhile"),
                                     session_id=SID)

                async def answer_came() -> bool:
                    return arrived(await stub_log(url), "answer") == 1

                await eventually(answer_came, "the answer at the server")
                await configure_stub(url, held_models=[])
                await asyncio.wait_for(replies.get(), 30)
                await watcher.wait_until(
                    lambda: bool(watcher.payloads("compaction.result")), 60)
        finally:
            await generator.stop()
            await nc.close()
        log = await stub_log(url)
    assert [r["status"] for r in watcher.payloads("compaction.result")] == ["completed"]
    assert arrived(log, "summary") >= 3, log  # a summary in several pieces
    # Planned for a 2,048 window, sent with the answers' own: Ollama reloads a
    # model asked with another num_ctx, each time the two take turns.
    assert {entry["num_ctx"] for entry in log if entry["event"] == "arrived"} == {8192}
    # The answer waited for the first piece only: the next one was held back
    # until the answer had begun, and the rest came after it.
    assert sent_while_the_answer_waited(log) == []
    events = [(entry["event"], entry["kind"]) for entry in log]
    assert events[:7] == [("arrived", "summary"), ("arrived", "answer"),
                          ("started", "summary"), ("first_chunk", "summary"),
                          ("done", "summary"), ("started", "answer"),
                          ("first_chunk", "answer")]
