"""A compaction's progress on `compaction.event`: announced, then one
`progress` before each summary piece and one when all are written, in order,
and only then its result. Against a real NATS server and the stand-in."""

from __future__ import annotations

import itertools
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.core.pieces import Piece
from services.shared.bus import parse_json, round_trip
from tests.test_compactor import compact_once


async def compaction_messages(nc: NATS, turns: list[tuple[str, str]], stub: str
                              ) -> tuple[list[dict[str, Any]], list[Piece], str]:
    """Every compaction event and result of one manual compaction, as they
    arrived, and the pieces its summariser wrote."""
    heard: list[dict[str, Any]] = []
    pieces: list[Piece] = []

    async def on_message(msg: Msg) -> None:
        heard.append(parse_json(msg.data)["payload"])

    async def written(sid: str, piece: Piece) -> None:
        pieces.append(piece)

    sub = await nc.subscribe("compaction.>", cb=on_message)
    try:
        result, _, _ = await compact_once(nc, stub, turns, written)
        await round_trip(nc)  # what was published before the result has arrived by now
        assert result.status == "completed", result
    finally:
        await sub.unsubscribe()
    sid = result.session_id
    return [m for m in heard if m["session_id"] == sid], pieces, sid


def long_turns(count: int, chars: int = 600) -> list[tuple[str, str]]:
    return [(f"question {i} " + "q" * chars, f"answer {i} " + "a" * (chars * 3 // 2))
            for i in range(count)]


async def test_progress_events_arrive_in_order_and_end_with_the_result(
        nc: NATS, stub_url: str) -> None:
    messages, pieces, _ = await compaction_messages(nc, long_turns(12), stub_url)
    assert len(pieces) > 1
    progress = [m for m in messages if m.get("event") == "progress"]
    assert messages[0]["event"] == "started"
    assert "status" in messages[-1]  # the result, after every event
    assert messages[1:-1] == progress
    done = [p["pieces_done"] for p in progress]
    assert done == list(range(len(pieces) + 1))  # before each piece, and once at the end
    assert progress[-1]["pieces_total"] == len(pieces)
    assert all(p["pieces_done"] <= p["pieces_total"] for p in progress)
    assert all(a["pieces_done"] <= b["pieces_done"] for a, b in itertools.pairwise(progress))


async def test_a_summary_in_one_piece_reports_one_of_one(nc: NATS, stub_url: str) -> None:
    messages, pieces, _ = await compaction_messages(nc, long_turns(3, 200), stub_url)
    assert len(pieces) == 1
    progress = [(m["pieces_done"], m["pieces_total"]) for m in messages
                if m.get("event") == "progress"]
    assert progress == [(0, 1), (1, 1)]
