"""The compactor on its own, against a real NATS server and the stand-in:
every attempt ends in exactly one `compaction.result`, whatever fails."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas import subjects
from schemas.history import ChatMessage
from schemas.messages import CompactionRequest, CompactionResult
from schemas.session import SessionRecord
from services.core.pieces import Piece
from services.core.state_machine import CompactionMode
from services.generator.compaction import Compactor, PieceWritten
from services.generator.provider import OllamaProvider
from services.generator.session_lock import SessionLocks
from services.generator.settings import GeneratorSettings
from services.generator.states import SessionStates
from services.generator.stops import StopSwitch
from services.shared.bus import Bus, decode
from services.shared.history_store import HistoryConflict, HistoryStore, HistoryView
from services.shared.jetstream import ensure_layout, locks_bucket
from services.shared.live_config import LiveSettings
from services.shared.sessions import SessionStore
from tests.stub_server import configure_stub, configure_stub_now, running_stub, stub_stats


@pytest.fixture
def held_summariser() -> Iterator[str]:
    """A stand-in whose summariser answers only once the test releases it."""
    with running_stub() as url:
        configure_stub_now(url, held_models=["summariser"])
        yield url


async def compactor_on(nc: NATS, stub: str, on_piece: PieceWritten | None = None,
                       **settings_: Any
                       ) -> tuple[Compactor, HistoryStore, SessionStore, OllamaProvider]:
    js = nc.jetstream()
    await ensure_layout(js)
    bus = Bus(nc, "compactor-test")
    settings = GeneratorSettings(**{"ollama_host": stub, "model": "stub-model",
                                    "compaction_model": "summariser",
                                    "compaction_tail_turns": 1, **settings_})
    history, sessions = HistoryStore(js), await SessionStore.open(js)
    locks = SessionLocks(await locks_bucket(js, None), "compactor-test", 5.0, 5.0)
    provider = OllamaProvider(stub, 30.0)
    compactor = Compactor(bus, LiveSettings(js, settings), provider, history, sessions, locks,
                          SessionStates(bus, "compactor-test", CompactionMode.background),
                          on_piece=on_piece)
    return compactor, history, sessions, provider


async def next_about(sid: str, queue: asyncio.Queue[Msg]) -> Msg:
    """The next message about this session (the server is shared with other tests)."""
    while True:
        msg = await asyncio.wait_for(queue.get(), 30)
        if (msg.headers or {}).get("Session-Id") == sid:
            return msg


async def add_turns(history: HistoryStore, sid: str, count: int, start: int = 0
                    ) -> HistoryView:
    view = await history.read(sid)
    for turn in range(start, start + count):
        view = await history.append(sid, view, [
            ChatMessage(role="user", content=f"question {turn} " + "words " * 50),
            ChatMessage(role="assistant", content=f"answer {turn} " + "words " * 50)])
    return view


async def test_a_request_delivered_again_after_its_splice_is_not_compacted_twice(
        nc: NATS, stub_url: str) -> None:
    """Its result or acknowledgement was lost, so the request comes back: even
    with new turns since, the history is compacted once, and the result says
    completed again."""
    compactor, history, sessions, provider = await compactor_on(nc, stub_url)
    sid = uuid.uuid4().hex
    await sessions.create(SessionRecord(session_id=sid))
    await add_turns(history, sid, 4)
    request = Bus(nc, "gateway").envelope(
        subjects.COMPACTION_REQUEST, CompactionRequest(session_id=sid, auto=False), session_id=sid)
    try:
        first = await compactor.handle(request)
        await add_turns(history, sid, 3, start=4)
        again = await compactor.handle(request)
    finally:
        await provider.close()
    assert first.status == again.status == "completed"
    assert again.summary == first.summary and again.note
    conversation = (await history.read(sid)).conversation
    assert conversation.compactions == 1 and conversation.compacted_by == request.message_id
    assert len(conversation.messages) == 2 + 3 * 2  # the tail turn kept, and the 3 since


async def test_an_emergency_compaction_whose_splice_is_refused_still_reports_it(
        nc: NATS, held_summariser: str) -> None:
    """A turn's emergency compaction loses its splice to a write behind its back
    (its holder was frozen past the lease): `compaction.result` says failed,
    and the turn sees the conflict."""
    compactor, history, sessions, provider = await compactor_on(nc, held_summariser)
    sid = uuid.uuid4().hex
    record = SessionRecord(session_id=sid, system="Be brief.")
    await sessions.create(record)
    view = await add_turns(history, sid, 4)
    started: asyncio.Queue[Msg] = asyncio.Queue()
    results: asyncio.Queue[Msg] = asyncio.Queue()
    subs = [await nc.subscribe(subjects.COMPACTION_EVENT, cb=started.put),
            await nc.subscribe(subjects.COMPACTION_RESULT, cb=results.put)]
    try:
        compacting = asyncio.create_task(
            compactor.compact_within_turn(record, view, uuid.uuid4().hex, StopSwitch("q")))
        await next_about(sid, started)  # the summary is being written now
        behind = HistoryStore(nc.jetstream())
        await behind.append(sid, await behind.read(sid), [
            ChatMessage(role="user", content="written by a newer holder")])
        await configure_stub(held_summariser, held_models=[])
        with pytest.raises(HistoryConflict):
            await compacting
        msg = await next_about(sid, results)
        result = decode(msg.data, CompactionResult, msg.subject).payload
        assert (result.status, result.level) == ("failed", "emergency")
        assert result.error and "HistoryConflict" in result.error
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await provider.close()


async def compact_once(nc: NATS, stub: str, turns: list[tuple[str, str]],
                       on_piece: PieceWritten | None = None
                       ) -> tuple[CompactionResult, HistoryView, HistoryView]:
    """One manual compaction of a session holding these turns (then one more, kept
    raw), by a summariser named `writer` with a 2,048-token window."""
    compactor, history, sessions, provider = await compactor_on(
        nc, stub, on_piece, compaction_model="writer", compaction_num_ctx=2048)
    sid = uuid.uuid4().hex
    await sessions.create(SessionRecord(session_id=sid, system="Be brief."))
    view = await history.read(sid)
    for question, answer in [*turns, ("the last question", "the last answer")]:
        view = await history.append(sid, view, [ChatMessage(role="user", content=question),
                                                ChatMessage(role="assistant", content=answer)])
    request = Bus(nc, "gateway").envelope(
        subjects.COMPACTION_REQUEST, CompactionRequest(session_id=sid, auto=False), session_id=sid)
    try:
        result = await compactor.handle(request)
    finally:
        await provider.close()
    return result, view, await history.read(sid)


async def test_a_zone_larger_than_the_summarisers_window_is_summarised_in_pieces(
        nc: NATS, stub_url: str) -> None:
    turns = [("Port the parser to Rust, keeping every error code.", "Starting.")]
    turns += [(f"question {i} " + "q" * 600, f"answer {i} " + "a" * 900) for i in range(12)]
    pieces: list[Piece] = []

    async def written(sid: str, piece: Piece) -> None:
        pieces.append(piece)

    before = await stub_stats(stub_url)
    result, _, after = await compact_once(nc, stub_url, turns, written)
    stats = (await stub_stats(stub_url))["models"]["writer"]
    assert result.status == "completed" and result.method == "summary", result
    # Progress piece by piece: each starts where the one before ended, to the zone's end.
    assert len(pieces) > 1 and pieces[0].start == 0 and pieces[-1].end == 2 * len(turns)
    assert all(a.end == b.start for a, b in itertools.pairwise(pieces))
    assert stats["requests"] - before["models"].get("writer", {}).get("requests", 0) > 1
    # Every call within the window, the summary's own room kept.
    assert stats["max_prompt_tokens"] <= 2048 - 256 and stats["truncated"] == 0
    assert after.conversation.summary is not None
    assert after.conversation.summary.startswith(
        "Goal: Port the parser to Rust, keeping every error code.")


async def test_a_summary_cut_off_at_its_length_limit_is_written_again_with_more_room(
        nc: NATS, stub_url: str) -> None:
    """The first call leaves 256 tokens (1,024 characters) for a summary of
    1,500: cut off, it is not spliced but asked for again with 512."""
    turns = [("Write the release notes.", "Sure."), ("the changes", "c" * 6000),
             ("!summary 1500 now", "ok")]
    result, _, after = await compact_once(nc, stub_url, turns)
    assert result.status == "completed" and result.method == "summary", result
    assert after.conversation.summary is not None and len(after.conversation.summary) == 1500


async def test_a_summary_cut_off_even_with_half_the_window_is_never_spliced(
        nc: NATS, stub_url: str) -> None:
    turns = [("Write the release notes.", "Sure."), ("!summary 100000 now", "ok")]
    result, before, after = await compact_once(nc, stub_url, turns)
    assert result.status == "failed" and result.error is not None
    assert "cut off at its length limit even with 1024 of the window's 2048" in result.error
    assert after.conversation == before.conversation


async def test_one_message_too_large_for_any_piece_is_cut_with_a_marker(
        nc: NATS, stub_url: str) -> None:
    pieces: list[Piece] = []

    async def written(sid: str, piece: Piece) -> None:
        pieces.append(piece)

    turns = [("Read the log.", "Done."), ("Show it", "log line\n" * 5000), ("Now?", "ok")]
    result, _, _ = await compact_once(nc, stub_url, turns, written)
    assert result.status == "completed" and result.method == "summary", result
    cut = [piece for piece in pieces if piece.cut_chars]
    assert len(cut) == 1 and cut[0].cut_chars > 30_000
    assert f"[… {cut[0].cut_chars:,} characters left out here" in cut[0].messages[1]["content"]
    stats = (await stub_stats(stub_url))["models"]["writer"]
    assert stats["max_prompt_tokens"] <= 2048 - 256 and stats["truncated"] == 0
