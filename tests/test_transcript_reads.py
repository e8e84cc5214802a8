"""Scrolling back through a long transcript, on a real NATS: a page reads
about as many entries as it holds, not every entry before it, and walking
back page by page gives what walking forward gives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from schemas import subjects
from schemas.history import ChatMessage, HistoryEntry
from services.core.transcript import Item
from services.shared.bus import round_trip
from services.shared.jetstream import ensure_layout
from services.shared.transcript import page, page_before

TURNS = 300
PAGE = 20
# Reads a page may take: the 11 entries it needs (two items each here), as
# many again at most from the last stretch read, one read ending each
# stretch, and the lookup of the last entry. Walking from the start took one
# read per entry before the page: 300 for the first page back.
MOST_READS_A_PAGE = 2 * PAGE


def turn(sid: str, index: int) -> bytes:
    return HistoryEntry.of_turn((ChatMessage(role="user", content=f"{sid} question {index}"),
                                 ChatMessage(role="assistant", content=f"answer {index}"))
                                ).model_dump_json().encode()


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_layout(js)
    yield js
    await nc.close()


async def write_turns(js: JetStreamContext, sids: list[str]) -> None:
    """TURNS turns for each session, their entries taking turns on the stream."""
    for index in range(TURNS):
        await asyncio.gather(*(js.publish(subjects.history(sid), turn(sid, index))
                               for sid in sids))


async def reads_of(counter: NATS, subs: list[Subscription]) -> int:
    """Direct gets seen so far: the server writes to a client in order, so a
    round trip brings every copy sent before it."""
    await round_trip(counter)
    return sum(sub.pending_msgs for sub in subs)


async def test_each_page_back_reads_about_what_it_holds(js: JetStreamContext,
                                                        nats_url: str) -> None:
    sid, others = "scrolled-back", ["busy-1", "busy-2", "busy-3"]
    await write_turns(js, [sid, *others])
    counter = await nats.connect(nats_url)
    # A get by sequence, and one of a subject's last entry.
    gets = [await counter.subscribe(f"$JS.API.DIRECT.GET.{subjects.HISTORY_STREAM}{tail}")
            for tail in ("", ".>")]
    await round_trip(counter)
    backwards: list[Item] = []
    before, pages = None, 0
    while True:
        seen = await reads_of(counter, gets)
        items, before = await page_before(js, sid, before, PAGE)
        reads = await reads_of(counter, gets) - seen
        assert reads <= MOST_READS_A_PAGE, f"page {pages} took {reads} reads"
        backwards = items + backwards
        pages += 1
        if before is None:
            break
    await counter.close()
    forwards, _ = await page(js, sid, None, 2 * TURNS + 1)
    assert backwards == forwards and len(forwards) == 2 * TURNS
    assert pages == TURNS * 2 // PAGE


async def test_a_page_back_without_entries_before_it_is_the_start(js: JetStreamContext) -> None:
    sid = "short-one"
    await write_turns(js, [sid])
    first, _ = await page(js, sid, None, 1)
    assert await page_before(js, sid, first[0].position, PAGE) == ([], None)
    assert await page_before(js, "never-written", None, PAGE) == ([], None)
