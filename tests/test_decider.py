"""The compaction decider in process, on a real NATS: what it remembers of
each session stays bounded however many sessions report."""

from __future__ import annotations

import nats

from schemas import subjects
from schemas.messages import GenerationReport
from services.compaction_decider.service import Decider
from services.compaction_decider.settings import DeciderSettings
from services.shared.bus import Bus
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


async def test_a_long_answer_in_a_dense_script_is_weighed_at_its_own_rate(
        private_nats: NatsServer) -> None:
    """English so far (4 characters a token), then a 5,000-character answer in
    Chinese: at the English ratio the next prompt looked like 3,750 tokens of
    a 7,168 budget, while Chinese costs 0.6-0.8 tokens a character."""
    nc = await nats.connect(private_nats.url)
    bus = Bus(nc, "compaction-decider")
    await ensure_layout(bus.js)
    decider = Decider(bus, DeciderSettings())
    await decider.start()
    requests = await nc.subscribe(subjects.COMPACTION_REQUEST)
    try:
        await bus.js_publish(subjects.RESPONSE_GENERATION, GenerationReport(
            session_id="zh", model="m", prompt_tokens=2500 - 4 * 4 + 16, sent_chars=10000,
            sent_messages=4, num_ctx=8192, next_prompt_chars=15000, next_prompt_messages=5,
            next_prompt_extra_bytes=10000, compactable_chars=6000,
            compactable_chars_by_level={"gentle": 6000, "tighter": 6000, "emergency": 9000},
        ), session_id="zh")
        request = await requests.next_msg(timeout=10)
        assert b'"session_id":"zh"' in request.data
    finally:
        await decider.stop()
        await nc.close()
