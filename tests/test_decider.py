"""The compaction decider in process, on a real NATS: what it remembers of
each session stays bounded however many sessions report."""

from __future__ import annotations

import json

import nats

from schemas import subjects
from schemas.messages import GenerationReport
from services.compaction_decider.service import Decider
from services.compaction_decider.settings import DeciderSettings
from services.core.context import PromptSize, context_tokens
from services.core.tokens import Calibration
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


def at_85_percent(sid: str, compactable_chars: int) -> GenerationReport:
    """A report of a session at 85% of an 8,192 window with 3,300 characters of notes,
    counted at the session's own ratio of 0.25 (this call gave no count of its own)."""
    return GenerationReport(
        session_id=sid, model="m", prompt_tokens=None, sent_chars=24000, sent_messages=9,
        num_ctx=8192, next_prompt_chars=24400, next_prompt_messages=10,
        compactable_chars=compactable_chars,
        compactable_chars_by_level={"gentle": compactable_chars}, summary_chars=3300,
        tokens_per_char=0.25)


async def test_the_decider_counts_at_the_sessions_ratio_and_nets_out_the_summary(
        private_nats: NatsServer) -> None:
    nc = await nats.connect(private_nats.url)
    bus = Bus(nc, "compaction-decider")
    await ensure_layout(bus.js)
    requests = await nc.subscribe(subjects.COMPACTION_REQUEST)
    decider = Decider(bus, DeciderSettings())
    await decider.start()
    try:
        # Only the notes and one short turn lie before the live zone: a compaction
        # would rewrite the notes and free almost nothing.
        await bus.js_publish(subjects.RESPONSE_GENERATION, at_85_percent("notes", 3360),
                             session_id="notes")
        # A 10,000-character paste lies there too: worth compacting.
        await bus.js_publish(subjects.RESPONSE_GENERATION, at_85_percent("paste", 13360),
                             session_id="paste")
        await consumer_caught_up(private_nats.url, subjects.GENERATIONS_STREAM,
                                 "compaction-decider")
        asked = json.loads((await requests.next_msg(timeout=5)).data)["payload"]
        assert asked["session_id"] == "paste"
        # The same count as the session's gauge: its ratio, not the fallback's.
        gauge = context_tokens(PromptSize(24400, 10), Calibration(0.25))
        assert asked["reason"].startswith(f"estimate {gauge} of budget 7168 tokens")
    finally:
        await decider.stop()
        await nc.close()
