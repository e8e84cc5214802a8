"""The compaction decider in process, on a real NATS: what it remembers of
each session stays bounded however many sessions report, and a request lost
on the way out or a result missed never turns automatic compaction off."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import CompactionRequest, CompactionResult, GenerationReport
from services.compaction_decider.service import CONSUMER, RESULTS_CONSUMER, Decider
from services.compaction_decider.settings import DeciderSettings
from services.core.context import context_tokens
from services.core.text_size import Size
from services.core.tokens import Calibration
from services.shared.bus import Bus, decode, round_trip
from services.shared.jetstream import ensure_layout
from tests.events import decider_caught_up, eventually, watching
from tests.nats_server import NatsServer
from tests.tcp_relay import Relay


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
        await decider_caught_up(private_nats.url, decider.status)
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


async def report_and_settle(bus: Bus, url: str, sid: str, decider: Decider) -> None:
    await bus.js_publish(subjects.RESPONSE_GENERATION, crowded_report(sid), session_id=sid)
    await decider_caught_up(url, decider.status)


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
        await report_and_settle(bus, private_nats.url, "lost-publish", decider)
        assert decider.status()["pending"] == [] and decider.status()["fired"] == 0
        await ensure_layout(bus.js)
        await report_and_settle(bus, private_nats.url, "lost-publish", decider)
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
        await report_and_settle(bus, private_nats.url, sid, decider)
        assert len(await stored_requests(bus)) == 1
        async with asyncio.timeout(20):
            while len(requests := await stored_requests(bus)) < 2:
                await asyncio.sleep(0.1)  # polling: each report asks whether the expiry passed
                await report_and_settle(bus, private_nats.url, sid, decider)
        assert len(requests) == 2 and "no result in time" in requests[1].payload.reason
        await bus.publish(subjects.COMPACTION_RESULT,
                          CompactionResult(session_id=sid, tokens_after=100),
                          correlation_id=requests[1].correlation_id, session_id=sid)
        await eventually(lambda: not decider.status()["pending"], "no request pending")
        await report_and_settle(bus, private_nats.url, sid, decider)
        requests = await stored_requests(bus)
        assert len(requests) == 3 and "no result in time" not in requests[2].payload.reason


async def test_a_report_read_after_the_result_of_a_compaction_it_predates_is_dropped(
        private_nats: NatsServer) -> None:
    async with running_decider(private_nats.url,
                               DeciderSettings(compaction_cooldown_s=0)) as (bus, decider):
        sid, url = "stale-report", private_nats.url
        await report_and_settle(bus, url, sid, decider)
        [request] = await stored_requests(bus)
        await bus.js_publish(subjects.COMPACTION_RESULT,
                             CompactionResult(session_id=sid, tokens_after=900, compactions=1),
                             correlation_id=request.correlation_id, session_id=sid)
        await eventually(lambda: not decider.status()["pending"], "the result heard")
        # Measured on the history before the splice, read only now.
        await bus.js_publish(subjects.RESPONSE_GENERATION,
                             crowded_report(sid).model_copy(update={"compactions": 0}),
                             session_id=sid)
        await decider_caught_up(url, decider.status)
        assert len(await stored_requests(bus)) == 1
        await bus.js_publish(subjects.RESPONSE_GENERATION,
                             crowded_report(sid).model_copy(update={"compactions": 1}),
                             session_id=sid)
        await decider_caught_up(url, decider.status)
        assert len(await stored_requests(bus)) == 2


async def test_a_decider_started_after_a_compaction_drops_the_reports_it_predates(
        private_nats: NatsServer) -> None:
    """A fresh decider tracked nothing, so it threw the completed result away,
    and a report measured before that compaction, read after it, asked for
    another one."""
    url, sid = private_nats.url, "restarted"
    async with running_decider(url, DeciderSettings(compaction_cooldown_s=0)) as (bus, decider):
        await bus.js_publish(subjects.COMPACTION_RESULT,
                             CompactionResult(session_id=sid, tokens_after=900, compactions=1),
                             session_id=sid)
        await eventually(lambda: decider.status()["tracked_sessions"] >= 1, "the result read")
        await bus.js_publish(subjects.RESPONSE_GENERATION,
                             crowded_report(sid).model_copy(update={"compactions": 0}),
                             session_id=sid)
        await decider_caught_up(url, decider.status)
        assert await stored_requests(bus) == []


async def test_a_compaction_count_the_later_reports_contradict_does_not_silence_them(
        private_nats: NatsServer) -> None:
    """A result claiming a million compactions (or a history deleted and begun
    again) left every later report out of date: the session was never compacted
    again. Reports stored past the grace after it are believed instead."""
    url, sid = private_nats.url, "claimed-too-many"
    nc = await nats.connect(url)
    bus = Bus(nc, "compaction-decider")
    await ensure_layout(bus.js)
    decider = Decider(bus, DeciderSettings(compaction_cooldown_s=0), stale_report_grace_s=0)
    await decider.start()
    try:
        await bus.js_publish(subjects.COMPACTION_RESULT,
                             CompactionResult(session_id=sid, tokens_after=900,
                                              compactions=1_000_000), session_id=sid)
        await eventually(lambda: decider.status()["tracked_sessions"] >= 1, "the result read")
        for _ in range(2):  # one alone may have been held up on its way
            await bus.js_publish(subjects.RESPONSE_GENERATION,
                                 crowded_report(sid).model_copy(update={"compactions": 0}),
                                 session_id=sid)
            await decider_caught_up(url, decider.status)
        assert len(await stored_requests(bus)) == 1
    finally:
        await decider.stop()
        await nc.close()


async def test_a_restarted_decider_reads_the_results_it_missed_before_the_reports(
        private_nats: NatsServer) -> None:
    """Both kept while it was away: a report measured before a compaction, then
    that compaction's result. Read by two loops at once, the report was at
    times judged first and asked for the compaction again, as an emergency."""
    url, sid = private_nats.url, "missed-both"
    settings = DeciderSettings(compaction_cooldown_s=0)
    async with running_decider(url, settings):
        pass  # its durable consumers made: what comes next waits for the next one
    publisher = await nats.connect(url)
    try:
        bus = Bus(publisher, "generator")
        await bus.js_publish(subjects.RESPONSE_GENERATION,
                             crowded_report(sid).model_copy(update={"compactions": 0}),
                             session_id=sid)
        for n in range(1000):  # a backlog of results the decider reads first
            await bus.js_publish(subjects.COMPACTION_RESULT,
                                 CompactionResult(session_id=f"other-{n}", tokens_after=1,
                                                  compactions=1), session_id=f"other-{n}")
        await bus.js_publish(subjects.COMPACTION_RESULT,
                             CompactionResult(session_id=sid, tokens_after=900, compactions=1),
                             session_id=sid)
    finally:
        await publisher.close()
    async with running_decider(url, settings) as (bus, decider):
        await decider_caught_up(url, decider.status)
        assert [r for r in await stored_requests(bus) if r.payload.session_id == sid] == []


async def test_a_report_whose_numbers_no_sum_can_use_is_reported_not_judged(
        private_nats: NatsServer) -> None:
    url, sid = private_nats.url, "huge"
    async with running_decider(url, DeciderSettings()) as (bus, decider), \
            watching(url, subjects.ERROR_SUBJECT) as errors:
        await bus.js_publish(subjects.RESPONSE_GENERATION,
                             crowded_report(sid).model_copy(update={"sent_chars": 10**400}),
                             session_id=sid)
        await errors.wait_for(lambda e: e["payload"].get("code") == "unusable_report")
        await report_and_settle(bus, url, "fine", decider)  # and it goes on
    with pytest.raises(ValueError, match="finite"):
        GenerationReport.model_validate({**crowded_report(sid).model_dump(),
                                         "tokens_per_char": float("inf")})


async def test_a_result_published_while_the_decider_was_cut_off_still_counts(
        private_nats: NatsServer) -> None:
    """Results are kept in a stream the decider reads: one published while its
    connection was down clears the pending request when it is back, long
    before the pending expiry would."""
    link = Relay(private_nats.url)
    await link.restore()
    down, up = asyncio.Event(), asyncio.Event()

    async def on_down() -> None:
        down.set()

    async def on_up() -> None:
        up.set()

    direct = await nats.connect(private_nats.url)
    generator = Bus(direct, "generator")
    await ensure_layout(generator.js)
    cut_off = await nats.connect(link.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1,
                                 disconnected_cb=on_down, reconnected_cb=on_up)
    decider = Decider(Bus(cut_off, "compaction-decider"), DeciderSettings(compaction_cooldown_s=0))
    await decider.start()
    sid = "cut-off"
    try:
        await report_and_settle(generator, private_nats.url, sid, decider)
        [first] = await stored_requests(generator)
        await link.cut()
        await asyncio.wait_for(down.wait(), 10)
        # The server must have seen the connection go: until then it may hand
        # the result to a pull request standing on the dead connection, and
        # only the ack wait (30 s) would bring it back.
        await eventually(lambda: no_pull_standing(generator, RESULTS_CONSUMER),
                         "the server dropped the decider's pull requests")
        await generator.js_publish(subjects.COMPACTION_RESULT,
                                   CompactionResult(session_id=sid, tokens_after=100),
                                   correlation_id=first.correlation_id, session_id=sid)
        await link.restore()
        await asyncio.wait_for(up.wait(), 10)
        await eventually(lambda: not decider.status()["pending"], "no request pending")
        await report_and_settle(generator, private_nats.url, sid, decider)
        requests = await stored_requests(generator)
        assert len(requests) == 2 and "no result in time" not in requests[1].payload.reason
    finally:
        await decider.stop()
        await cut_off.close()
        await direct.close()
        await link.cut()
async def no_pull_standing(bus: Bus, durable: str) -> bool:
    info = await bus.js.consumer_info(subjects.RESULTS_STREAM, durable)
    return not info.num_waiting


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
        await decider_caught_up(private_nats.url, decider.status)
        asked = json.loads((await requests.next_msg(timeout=5)).data)["payload"]
        assert asked["session_id"] == "paste"
        # The same count as the session's gauge: its ratio, not the fallback's.
        gauge = context_tokens(Size(24400, 0, 10), Calibration(0.25))
        assert asked["reason"].startswith(f"estimate {gauge} of budget 7168 tokens")
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


async def test_what_a_compaction_frees_in_a_dense_script_is_priced_by_its_bytes(
        private_nats: NatsServer) -> None:
    """All Chinese (two bytes beyond each character's first), at 87% of the
    budget, 3,000 of its 5,000 characters before the live zone: about 3,750
    tokens to free. Priced as if they were plain characters, 750, less than
    the summary written in their place, and the session was left to fill up."""
    async with running_decider(private_nats.url, DeciderSettings()) as (bus, decider):
        await bus.js_publish(subjects.RESPONSE_GENERATION, GenerationReport(
            session_id="dense", model="m", prompt_tokens=None, sent_chars=4800,
            sent_messages=19, num_ctx=8192, next_prompt_chars=5000, next_prompt_messages=20,
            next_prompt_extra_bytes=10000, compactable_chars=3000,
            compactable_chars_by_level={"gentle": 3000}, tokens_per_char=0.25,
            tokens_per_extra_byte=0.5), session_id="dense")
        await decider_caught_up(private_nats.url, decider.status)
        [request] = await stored_requests(bus)
        assert request.payload.session_id == "dense" and request.payload.level == "gentle"


async def test_reports_are_judged_without_an_acknowledgement_each(
        private_nats: NatsServer) -> None:
    """A report costs the server one delivery to the decider, not also an
    acknowledgement coming back."""
    async with running_decider(private_nats.url, DeciderSettings()) as (bus, decider):
        acks = await bus.nc.subscribe(f"$JS.ACK.{subjects.GENERATIONS_STREAM}.>")
        for sid in ("a", "b", "c"):
            await bus.js_publish(subjects.RESPONSE_GENERATION, report(sid), session_id=sid)
        await decider_caught_up(private_nats.url, decider.status)
        assert decider.status()["tracked_sessions"] == 3
        await round_trip(bus.nc)  # an acknowledgement sent would be back by now
        assert acks.pending_msgs == 0


async def test_an_upgraded_decider_goes_on_after_the_last_report_its_consumer_delivered(
        private_nats: NatsServer) -> None:
    """An earlier version acknowledged each report; the server keeps a
    consumer's ack policy, so the consumer is made again, from where it stood."""
    nc = await nats.connect(private_nats.url)
    try:
        bus = Bus(nc, "compaction-decider")
        await ensure_layout(bus.js)
        await bus.js.add_consumer(subjects.GENERATIONS_STREAM, ConsumerConfig(
            durable_name=CONSUMER, filter_subject=subjects.RESPONSE_GENERATION,
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW, ack_wait=30))
        for sid in ("read-before", "read-before-too"):
            await bus.js_publish(subjects.RESPONSE_GENERATION, report(sid), session_id=sid)
        old = await bus.js.pull_subscribe_bind(CONSUMER, stream=subjects.GENERATIONS_STREAM)
        for msg in await old.fetch(2):
            await msg.ack()
        await old.unsubscribe()
        await bus.js_publish(subjects.RESPONSE_GENERATION, report("new"), session_id="new")
    finally:
        await nc.close()
    async with running_decider(private_nats.url, DeciderSettings()) as (_, decider):
        await decider_caught_up(private_nats.url, decider.status)
        assert decider.status()["tracked_sessions"] == 1  # "new" alone


async def test_a_report_that_does_not_say_what_could_be_freed_still_gets_a_compaction(
        private_nats: NatsServer) -> None:
    """`compactable_chars` is optional in the contract: a generator that left
    it out was taken to have nothing to free, and its sessions were never
    compacted, however full."""
    async with running_decider(private_nats.url, DeciderSettings()) as (bus, decider):
        await bus.js_publish(subjects.RESPONSE_GENERATION, GenerationReport(
            session_id="silent", model="m", prompt_tokens=7000, sent_chars=28000,
            sent_messages=12, num_ctx=8192), session_id="silent")
        await decider_caught_up(private_nats.url, decider.status)
        [request] = await stored_requests(bus)
        assert request.payload.session_id == "silent"
