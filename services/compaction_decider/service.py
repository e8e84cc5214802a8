"""The decider process: a thin shell around `services.core.decision`.

It replays `response.generation` through a durable consumer (so nothing is
missed across its restarts), keeps each session's calibration and hysteresis
memory, and publishes `compaction.request` when the pure decision says so.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import CompactionRequest, CompactionResult, GenerationReport
from services.compaction_decider.settings import DeciderSettings
from services.core.decision import (
    Decision,
    Observation,
    Policy,
    SessionMemory,
    decide,
    level_for,
    on_result,
)
from services.core.tokens import Calibration, calibrate, estimate_tokens, prompt_budget
from services.shared.bus import Bus
from services.shared.consumer import PullLoop, ensure_consumer
from services.shared.live_config import LiveSettings
from services.shared.runner import Endpoint

CONSUMER = "compaction-decider"
log = structlog.get_logger()


class Decider:
    def __init__(self, bus: Bus, settings: DeciderSettings) -> None:
        self._bus = bus
        self._live = LiveSettings(bus.js, settings)
        self._calibration: dict[str, Calibration] = {}
        self._memory: dict[str, SessionMemory] = {}
        # The correlation id of the request each session's pending flag is for:
        # only the result of *that* compaction clears it.
        self._awaiting: dict[str, str] = {}
        self._loop: PullLoop | None = None
        self._results: Subscription | None = None
        self._fired = 0

    @property
    def settings(self) -> DeciderSettings:
        return self._live.current

    def policy(self) -> Policy:
        s = self.settings
        return Policy(threshold=s.compaction_threshold, cooldown_s=s.compaction_cooldown_s,
                      min_relief=s.compaction_min_relief)

    async def start(self) -> None:
        await self._live.start()
        self._results = await self._bus.nc.subscribe(subjects.COMPACTION_RESULT,
                                                     cb=self._on_result)
        await ensure_consumer(self._bus.nc, subjects.GENERATIONS_STREAM, ConsumerConfig(
            durable_name=CONSUMER, filter_subject=subjects.RESPONSE_GENERATION,
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW, ack_wait=30))
        self._loop = PullLoop(self._bus.nc, subjects.GENERATIONS_STREAM, CONSUMER,
                              self._on_message)
        await self._loop.start()

    async def stop(self) -> None:
        await self._live.stop()
        if self._loop:
            await self._loop.stop()
        if self._results:
            await self._results.unsubscribe()

    def endpoints(self) -> list[Endpoint]:
        return []

    def status(self) -> dict[str, Any]:
        return {"threshold": self.settings.compaction_threshold, "fired": self._fired,
                "pending": sorted(s for s, m in self._memory.items() if m.pending)}

    async def _on_message(self, msg: Msg) -> None:
        await self._on_generation(msg)
        await msg.ack()

    async def _on_generation(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, GenerationReport)
        if env is None:
            return
        with structlog.contextvars.bound_contextvars(
            session_id=env.payload.session_id, correlation_id=env.correlation_id
        ):
            await self._consider(env)

    async def _consider(self, env: Envelope[GenerationReport]) -> None:
        report, sid = env.payload, env.payload.session_id
        cal = calibrate(self._calibration.get(sid, Calibration()), report.prompt_tokens,
                        report.sent_chars, report.num_ctx, reused_chars=report.reused_chars,
                        messages=report.sent_messages)
        self._calibration[sid] = cal
        if not report.auto_compact:
            return
        decision = self._decide(sid, report, cal)
        if not decision.fire or decision.level is None:
            log.debug("no_compaction", reason=decision.reason)
            return
        log.info("compaction_requested", level=decision.level.value, reason=decision.reason)
        request, _ = await self._bus.js_publish(
            subjects.COMPACTION_REQUEST,
            CompactionRequest(session_id=sid, auto=True, reason=decision.reason,
                              level=decision.level.value),
            session_id=sid,
        )
        self._awaiting[sid] = request.correlation_id
        self._fired += 1

    def _decide(self, sid: str, report: GenerationReport, cal: Calibration) -> Decision:
        limit = prompt_budget(report.num_ctx, self.settings.output_headroom)
        upcoming = estimate_tokens(report.next_prompt_chars or report.sent_chars, cal,
                                   report.next_prompt_messages)
        level = level_for(upcoming, limit, self.policy())
        # What a compaction at that level could free: its own, smaller live zone.
        freeable = report.compactable_chars or 0
        if level is not None:
            freeable = report.compactable_chars_by_level.get(level.value, freeable)
        obs = Observation(next_prompt_tokens=upcoming, budget=limit,
                          compactable_tokens=estimate_tokens(freeable, cal),
                          now=time.monotonic())
        decision, memory = decide(obs, self._memory.get(sid, SessionMemory()), self.policy())
        self._memory[sid] = memory
        return decision

    async def _on_result(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, CompactionResult)
        if env is None:
            return
        sid = env.payload.session_id
        if sid in self._memory and self._awaiting.get(sid) == env.correlation_id:
            del self._awaiting[sid]
            self._memory[sid] = on_result(self._memory[sid], env.payload.tokens_after,
                                          time.monotonic())
