"""The decider process: a thin shell around `services.core.decision`.

It reads `response.generation` through a durable consumer (so a restart
resumes where it stopped), keeps each session's calibration and hysteresis
memory, and publishes `compaction.request` when the pure decision says so.

Reports are not acknowledged: one delivered is taken as read. Each report
carries all a decision needs, so one lost to a crash mid-way costs a single
reading, while an acknowledgement was a message through the server on every
turn (scripts/bench.py, turn_messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects
from schemas.envelope import Envelope, new_id
from schemas.messages import CompactionRequest, CompactionResult, ErrorReport, GenerationReport
from services.compaction_decider.settings import DeciderSettings
from services.core.context import context_tokens
from services.core.decision import (
    STALE_REPORT_GRACE_S,
    Decision,
    Policy,
    SessionMemory,
    decide,
    on_compacted,
    on_report,
    on_result,
)
from services.core.observation import observe, report_calibration
from services.core.text_size import Size
from services.core.tokens import (
    Calibration,
    calibrate,
)
from services.shared import metrics
from services.shared.bus import Bus
from services.shared.consumer import PullLoop, ensure_consumer
from services.shared.live_config import LiveSettings
from services.shared.nats_away import NATS_AWAY, patiently
from services.shared.recent import Recent
from services.shared.runner import Endpoint

CONSUMER = "compaction-decider"
RESULTS_CONSUMER = "compaction-decider-results"
# Sessions whose calibration and hysteresis are kept; the least recently
# reported is forgotten first (its next report calibrates it afresh).
MAX_TRACKED_SESSIONS = 10_000
# Under a steady flow of reports, the decider reads what came in this long at
# once rather than waking for each: a compaction asked for this much later is
# no later in any way a turn can tell, and a wake-up per turn was most of the
# decider's CPU (scripts/bench.py, turn_cpu).
REPORT_LINGER_S = 0.05
# How long a start waits for the results sent while it was away to be read.
RESULTS_BACKLOG_WAIT_S = 10.0
log = structlog.get_logger()


@dataclass
class Tracked:
    """What the decider remembers of one session."""

    calibration: Calibration = field(default_factory=Calibration)
    memory: SessionMemory = field(default_factory=SessionMemory)
    # The correlation id of the request the pending flag is for: only the
    # result of *that* compaction clears it.
    awaiting: str | None = None


class Decider:
    def __init__(self, bus: Bus, settings: DeciderSettings,
                 max_tracked: int = MAX_TRACKED_SESSIONS,
                 stale_report_grace_s: float = STALE_REPORT_GRACE_S) -> None:
        self._bus = bus
        self._stale_report_grace_s = stale_report_grace_s
        self._live = LiveSettings(bus.js, settings)
        self._tracked: Recent[str, Tracked] = Recent(max_tracked)
        self._loop: PullLoop | None = None
        self._results: PullLoop | None = None
        self._consumer = ConsumerConfig(
            durable_name=CONSUMER, filter_subject=subjects.RESPONSE_GENERATION,
            ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.NEW)
        # Where a consumer made again starts: just after the last report
        # handled (the server's own time of it), else this process's start.
        self._resume_at = datetime.now(UTC)
        self._results_consumer = ConsumerConfig(
            durable_name=RESULTS_CONSUMER, filter_subject=subjects.COMPACTION_RESULT,
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW, ack_wait=30)
        self._fired = 0
        self._result_read = asyncio.Event()
        # The GENERATIONS sequence of the last report judged: whoever waits for
        # the decider to catch up reads it from the status.
        self._judged = 0

    @property
    def settings(self) -> DeciderSettings:
        return self._live.current

    def policy(self) -> Policy:
        s = self.settings
        return Policy(threshold=s.compaction_threshold, cooldown_s=s.compaction_cooldown_s,
                      min_relief=s.compaction_min_relief,
                      pending_expiry_s=s.compaction_result_timeout_s)

    async def start(self) -> None:
        await self._live.start()
        # Durable, so a result published while this process was disconnected
        # (a NATS restart, a network cut) is still read when it is back.
        await ensure_consumer(self._bus.nc, subjects.RESULTS_STREAM, self._results_consumer)
        self._results = PullLoop(self._bus.nc, subjects.RESULTS_STREAM, RESULTS_CONSUMER,
                                 self._on_result_message)
        await self._results.start()
        await self._read_results_backlog()
        await ensure_consumer(self._bus.nc, subjects.GENERATIONS_STREAM, self._consumer)
        self._loop = PullLoop(self._bus.nc, subjects.GENERATIONS_STREAM, CONSUMER,
                              self._on_message, linger_s=REPORT_LINGER_S)
        await self._loop.start()

    async def reconnected(self) -> None:
        """NATS came back, perhaps without its store: the settings watch and
        the consumers are made again. Results lost with the store are covered
        by the pending request's expiry."""
        await self._live.watch_again()
        if await ensure_consumer(self._bus.nc, subjects.RESULTS_STREAM, self._results_consumer) \
                and self._results:
            self._results.renew()
        # Made again, it must not start at the newest report as a first start
        # does: the reports of a stream made anew, sent before this process
        # got back, would be skipped.
        resumed = self._consumer.evolve(deliver_policy=DeliverPolicy.BY_START_TIME,
                                        opt_start_time=self._resume_at)
        created = await ensure_consumer(self._bus.nc, subjects.GENERATIONS_STREAM, resumed)
        if created and self._loop:
            log.info("consumer_made_again", consumer=CONSUMER, start=self._resume_at.isoformat())
            self._loop.renew()

    async def stop(self) -> None:
        await self._live.stop()
        if self._loop:
            await self._loop.stop()
        if self._results:
            await self._results.stop()

    def endpoints(self) -> list[Endpoint]:
        return []

    def status(self) -> dict[str, Any]:
        return {"threshold": self.settings.compaction_threshold, "fired": self._fired,
                "tracked_sessions": len(self._tracked), "last_report_seq": self._judged,
                "pending": sorted(s for s, t in self._tracked.items() if t.memory.pending)}

    def _track(self, sid: str) -> Tracked:
        """The session's memory, made the most recent; the oldest is forgotten."""
        tracked = self._tracked.get(sid) or Tracked()
        self._tracked.put(sid, tracked)
        return tracked

    async def _on_message(self, msg: Msg) -> None:
        await self._on_generation(msg)
        self._judged = msg.metadata.sequence.stream
        self._resume_at = msg.metadata.timestamp + timedelta(microseconds=1)

    async def _on_generation(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, GenerationReport)
        if env is None:
            return
        with structlog.contextvars.bound_contextvars(
            session_id=env.payload.session_id, correlation_id=env.correlation_id
        ):
            try:
                await self._consider(env, msg.metadata.timestamp.timestamp())
            except ArithmeticError as err:  # counts a schema allows but no sum can use
                log.warning("report_unusable", error=f"{type(err).__name__}: {err}")
                await self._bus.publish(subjects.ERROR_SUBJECT, ErrorReport(
                    code="unusable_report", message=f"{type(err).__name__}: {err}",
                    subject=msg.subject), session_id=env.payload.session_id)

    async def _consider(self, env: Envelope[GenerationReport], stored_at: float) -> None:
        report, sid = env.payload, env.payload.session_id
        tracked = self._track(sid)
        tracked.memory = self._believed(tracked.memory, report, stored_at)
        before = tracked.calibration
        tracked.calibration = calibrate(
            before, report.prompt_tokens, report.sent_chars, report.num_ctx,
            messages=report.sent_messages, extra_bytes=report.sent_extra_bytes,
            reused_chars=report.reused_chars, reused_extra_bytes=report.reused_extra_bytes,
            reused_messages=report.reused_messages)
        _check_estimate(before, tracked.calibration, report)
        if not report.auto_compact:
            return
        decision, fired = self._decide(tracked, report)
        if not decision.fire or decision.level is None:
            log.debug("no_compaction", reason=decision.reason)
            return
        log.info("compaction_requested", level=decision.level.value, reason=decision.reason)
        # The result names the request by its correlation id. It is awaited even
        # when the publish seems to fail: a lost acknowledgement may hide a
        # request that was stored, and its result then still counts.
        correlation_id = tracked.awaiting = new_id()
        if await self._request(sid, decision, correlation_id):
            self._fired += 1
            metrics.decider().requests.labels(decision.level.value).inc()
            # Pending only once the request is stored, and only if its result
            # has not already come meanwhile (it clears `awaiting`).
            if tracked.awaiting == correlation_id:  # onto what was heard of meanwhile
                tracked.memory = replace(tracked.memory, pending=fired.pending,
                                         last_fired_at=fired.last_fired_at)

    async def _request(self, sid: str, decision: Decision, correlation_id: str) -> bool:
        """Publish the request; False (logged) when it was not confirmed stored."""
        assert decision.level is not None
        try:
            await self._bus.js_publish(
                subjects.COMPACTION_REQUEST,
                CompactionRequest(session_id=sid, auto=True, reason=decision.reason,
                                  level=decision.level.value),
                correlation_id=correlation_id, session_id=sid,
            )
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("compaction_request_not_sent", error=repr(err),
                        request_correlation_id=correlation_id)
            return False
        return True

    def _believed(self, memory: SessionMemory, report: GenerationReport, stored_at: float
                  ) -> SessionMemory:
        """The memory after the report, with a count the report proved wrong logged."""
        after = on_report(memory, report.compactions, stored_at, self._stale_report_grace_s)
        if after.compactions != memory.compactions:
            log.warning("compaction_count_corrected", believed=memory.compactions,
                        reported=report.compactions)
        return after

    def _decide(self, tracked: Tracked, report: GenerationReport
                ) -> tuple[Decision, SessionMemory]:
        obs = observe(report, report_calibration(report, tracked.calibration),
                      self.settings.output_headroom, self.policy(), time.monotonic())
        return decide(obs, tracked.memory, self.policy())

    async def _read_results_backlog(self) -> None:
        """The results sent while this consumer was away are read before any
        report: judged first, a report older than a compaction it has not
        heard of yet asked for that compaction again, at the emergency level
        its crowded prompt called for. Waited for a bounded while only."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESULTS_BACKLOG_WAIT_S
        while (left := deadline - loop.time()) > 0:
            try:  # an election, a reconnect: asked again, as any read while NATS is away
                info = await patiently(lambda: self._bus.js.consumer_info(
                    subjects.RESULTS_STREAM, RESULTS_CONSUMER), left, "results_backlog_unknown")
            except NATS_AWAY:
                break
            if not info.num_pending and not info.num_ack_pending:
                return
            self._result_read.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._result_read.wait(), 0.5)
        log.warning("results_backlog_not_read", waited_s=RESULTS_BACKLOG_WAIT_S)

    async def _on_result_message(self, msg: Msg) -> None:
        await self._on_result(msg)
        await msg.ack()
        self._result_read.set()

    async def _on_result(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, CompactionResult)
        if env is None:
            return
        tracked = self._tracked.get(env.payload.session_id)
        if tracked is None:
            if env.payload.status != "completed":
                return
            # Unknown here (a decider started since): what the compaction made
            # is still the line before which a report is stale.
            tracked = self._track(env.payload.session_id)
        if env.payload.status == "completed":
            tracked.memory = on_compacted(tracked.memory, env.payload.compactions,
                                          msg.metadata.timestamp.timestamp())
        if tracked.awaiting == env.correlation_id:
            tracked.awaiting = None
            tracked.memory = on_result(tracked.memory, env.payload.tokens_after,
                                       time.monotonic())


def _check_estimate(before: Calibration, after: Calibration, report: GenerationReport) -> None:
    """How far the session's estimate, before a count, was from it: dense
    scripts' bytes included, and only for a count read as the whole prompt's
    (one a prompt cache may have cut says nothing of the estimate)."""
    whole = after.basis is not None and after.basis is not before.basis
    sent = Size(report.sent_chars, report.sent_extra_bytes, report.sent_messages)
    metrics.decider().estimate_checked(context_tokens(sent, before),
                                       report.prompt_tokens if whole else None)
