"""The compaction decider in process, on a real NATS: what it remembers of
each session stays bounded however many sessions report, and a request lost
on the way out or a result missed never turns automatic compaction off."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import nats

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import CompactionRequest, CompactionResult, GenerationReport
from services.compaction_decider.service import Decider
from services.compaction_decider.settings import DeciderSettings
from services.shared.bus import Bus, decode
from services.shared.jetstream import ensure_layout
from tests.events import consumer_caught_up
from tests.nats_server import NatsServer


def report(sid: str) -> GenerationReport:
    return GenerationReport(session_id=sid, model="m", prompt_tokens=100, sent_chars=400,
                            sent_messages=2, num_ctx=8192, next_prompt_chars=500)


async def test_no_more_sessions_are_remembered_than_the_bound(
        private_nats: NatsServer) -> None:
    nc = await nats.connect(private_nats.url)
    bus = Bus(nc, "compaction-decider")
    await ensure_layout(bus.js)
    decider = Decider(bus, DeciderSettings(), max_tracked=2)
    await decider.start()
    try:
        for sid in ("a", "b", "c", "a"):
            await bus.js_publish(subjects.RESPONSE_GENERATION, report(sid), session_id=sid)
        await consumer_caught_up(private_nats.url, subjects.GENERATIONS_STREAM,
                                 "compaction-decider")
        assert decider.status()["tracked_sessions"] == 2
    finally:
        await decider.stop()
        await nc.close()


def crowded_report(sid: str) -> GenerationReport:
    """A session whose next prompt is near the window, with plenty to compact."""
    return GenerationReport(session_id=sid, model="m", prompt_tokens=7000, sent_chars=28000,
                            sent_messages=10, num_ctx=8192, next_prompt_chars=28400,
                            next_prompt_messages=10, compactable_chars=20000,
                            compactable_chars_by_level={"gentle": 20000, "tighter": 22000,
                                                        "emergency": 24000})


async def stored_requests(bus: Bus) -> list[Envelope[CompactionRequest]]:
    """The compaction requests in the work queue (no generator takes them here)."""
    state = (await bus.js.stream_info(subjects.COMPACTIONS_STREAM)).state
    if state.messages == 0:
        return []
    found = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await bus.js.get_msg(subjects.COMPACTIONS_STREAM, seq)
        found.append(decode(msg.data or b"", CompactionRequest, subjects.COMPACTION_REQUEST))
    return found


async def settled(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until the decider's state meets `condition` (it changes in its own tasks)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


async def report_and_settle(bus: Bus, url: str, sid: str) -> None:
    await bus.js_publish(subjects.RESPONSE_GENERATION, crowded_report(sid), session_id=sid)
    await consumer_caught_up(url, subjects.GENERATIONS_STREAM, "compaction-decider")


@contextlib.asynccontextmanager
async def running_decider(url: str, settings: DeciderSettings) -> AsyncIterator[
        tuple[Bus, Decider]]:
    nc = await nats.connect(url)
    bus = Bus(nc, "compaction-decider")
    await ensure_layout(bus.js)
    decider = Decider(bus, settings)
    await decider.start()
    try:
        yield bus, decider
    finally:
        await decider.stop()
        await nc.close()


async def test_a_request_that_was_not_stored_leaves_the_session_free(
        private_nats: NatsServer) -> None:
    """With the work queue gone the publish fails: nothing may be marked pending,
    so the next report, once the queue is back, asks again."""
    async with running_decider(private_nats.url,
                               DeciderSettings(compaction_cooldown_s=0)) as (bus, decider):
        await bus.js.delete_stream(subjects.COMPACTIONS_STREAM)
        await report_and_settle(bus, private_nats.url, "lost-publish")
        assert decider.status()["pending"] == [] and decider.status()["fired"] == 0
        await ensure_layout(bus.js)
        await report_and_settle(bus, private_nats.url, "lost-publish")
        requests = await stored_requests(bus)
        assert [r.payload.session_id for r in requests] == ["lost-publish"]
        assert decider.status()["pending"] == ["lost-publish"]


async def test_a_missed_result_does_not_stop_automatic_compaction(
        private_nats: NatsServer) -> None:
    """The first request's result never comes: after the expiry the session is
    asked for again, and the result of that second request is honoured."""
    settings = DeciderSettings(compaction_cooldown_s=0, compaction_result_timeout_s=0.5)
    async with running_decider(private_nats.url, settings) as (bus, decider):
        sid = "lost-result"
        await report_and_settle(bus, private_nats.url, sid)
        assert len(await stored_requests(bus)) == 1
        async with asyncio.timeout(20):
            while len(requests := await stored_requests(bus)) < 2:
                await asyncio.sleep(0.1)  # polling: each report asks whether the expiry passed
                await report_and_settle(bus, private_nats.url, sid)
        assert len(requests) == 2 and "no result in time" in requests[1].payload.reason
        await bus.publish(subjects.COMPACTION_RESULT,
                          CompactionResult(session_id=sid, tokens_after=100),
                          correlation_id=requests[1].correlation_id, session_id=sid)
        await settled(lambda: not decider.status()["pending"])
        await report_and_settle(bus, private_nats.url, sid)
        requests = await stored_requests(bus)
        assert len(requests) == 3 and "no result in time" not in requests[2].payload.reason
