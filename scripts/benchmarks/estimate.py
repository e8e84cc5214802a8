"""Row estimate_error: how far the generator's token estimate of a prompt is from
the provider's count, over models of several characters per token; live through
the system, or with --in-process the generator's estimate/calibrate loop
emulated on the stand-in's tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import nats

from schemas import subjects
from schemas.envelope import Envelope
from schemas.history import ChatMessage, Conversation, HistoryEntry
from schemas.messages import GenerationReport
from scripts.benchmarks.client import Http, ask_ok, configure_stub, http_client, new_session
from scripts.benchmarks.harness import NUM_CTX, Env, Row, Target
from scripts.ollama_stub import count_prompt_tokens, echo_reply, filler_text
from services.core.prompt import render_messages
from services.core.prompt_cache import cached_size, previous_call
from services.core.text_size import prompt_size
from services.core.tokens import Calibration, calibrate, estimate_tokens
from services.shared.bus import round_trip

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

ESTIMATE_MAX_ERROR_PCT = 5.0
CHARS_PER_TOKEN = (2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
ESTIMATE_SYSTEM = "You are a patient gardening assistant. Answer briefly and concretely."
ESTIMATE_SCRIPT = (
    "Hello! Can you help me plan a small vegetable garden?",
    "I have about 20 square metres, partly shaded in the afternoon, clay soil. " * 4,
    "!long 1200 Tell me everything about growing tomatoes there.",
    "ok",
    "Here are my notes from last year: " + filler_text(1500, 11),
    "!long 400 And peppers?",
)


@dataclass(frozen=True)
class EstimatePoint:
    turn: int
    estimate: int
    actual: int

    @property
    def error_pct(self) -> float:
        return (self.estimate - self.actual) / self.actual * 100


def fit_check_estimate(system: str, conversation: Conversation, content: str,
                       calibration: Calibration) -> tuple[int, int]:
    """(tokens, chars) of the next prompt as the generator's fit check estimates it."""
    prompt = render_messages(system, conversation, [ChatMessage(role="user", content=content)])
    chars = prompt_size(prompt).chars
    return estimate_tokens(chars, calibration, len(prompt)), chars


def estimate_points_offline(cpt: float, script: Sequence[str]) -> list[EstimatePoint]:
    """The generator's estimate/calibrate loop emulated in-process, with the stand-in's
    tokenizer and reply rules as the provider."""
    conversation = Conversation()
    calibration = Calibration()
    points: list[EstimatePoint] = []
    for turn, content in enumerate(script, 1):
        user = ChatMessage(role="user", content=content)
        prompt = render_messages(ESTIMATE_SYSTEM, conversation, [user])
        size = prompt_size(prompt)
        estimate = estimate_tokens(size.chars, calibration, size.messages, size.extra_bytes)
        actual = count_prompt_tokens(prompt, None, cpt)
        if calibration.reports:
            points.append(EstimatePoint(turn, estimate, actual))
        # As the generator does: the part a prompt cache may have served, read
        # off the history, so a count of the rest alone is not taken for the whole.
        reused = cached_size(previous_call(ESTIMATE_SYSTEM, conversation), prompt)
        calibration = calibrate(calibration, actual, size.chars, NUM_CTX,
                                messages=size.messages, extra_bytes=size.extra_bytes,
                                reused_chars=reused.chars,
                                reused_extra_bytes=reused.extra_bytes,
                                reused_messages=reused.messages)
        answer = ChatMessage(role="assistant", content=echo_reply(prompt))
        conversation = conversation.apply(HistoryEntry.of_turn((user, answer)))
    return points


class ReportWatch:
    """response.generation reports, per session, in order."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[GenerationReport]] = {}

    def queue(self, sid: str) -> asyncio.Queue[GenerationReport]:
        return self._queues.setdefault(sid, asyncio.Queue())

    async def on_message(self, msg: Any) -> None:
        report = Envelope[GenerationReport].model_validate_json(msg.data).payload
        self.queue(report.session_id).put_nowait(report)


def calibrated_by(report: GenerationReport, calibration: Calibration) -> Calibration:
    """The calibration after `report`, as the generator makes it."""
    return calibrate(calibration, report.prompt_tokens, report.sent_chars,
                     report.num_ctx, messages=report.sent_messages,
                     extra_bytes=report.sent_extra_bytes,
                     reused_chars=report.reused_chars,
                     reused_extra_bytes=report.reused_extra_bytes,
                     reused_messages=report.reused_messages)


async def read_session(http: Http, sid: str) -> tuple[dict[str, Any], Conversation]:
    """The session as the gateway shows it, and its conversation."""
    session = (await http.get(f"/api/sessions/{sid}")).json()
    conversation = Conversation(
        summary=session["summary"], compactions=session["compactions"],
        messages=tuple(ChatMessage.model_validate(m) for m in session["messages"]))
    return session, conversation


async def estimate_points_live(env: Env, http: Http, watch: ReportWatch,
                               cpt: float, script: Sequence[str]
                               ) -> tuple[list[EstimatePoint], dict[str, Any]]:
    """A session through the real system at `cpt` characters per token. Before each turn
    after the first: the generator's fit-check estimate of that turn's exact prompt, from
    the previous turn's provider report (pure functions); after it, the provider's count."""
    await configure_stub(env.stub_url, chars_per_token=cpt)
    sid = await new_session(http, ESTIMATE_SYSTEM)
    reports = watch.queue(sid)
    calibration = Calibration()
    pending: tuple[int, int] | None = None  # estimate, chars of the next prompt
    points: list[EstimatePoint] = []
    chars_mismatches = 0
    gateway_deltas: list[int] = []
    for turn, content in enumerate(script, 1):
        reply = await ask_ok(http, sid, content)
        report = await asyncio.wait_for(reports.get(), 15.0)
        actual = int(reply["prompt_tokens"])
        if report.prompt_tokens != actual:
            raise RuntimeError(f"report {report.prompt_tokens} != reply {actual} tokens")
        if pending is not None:
            points.append(EstimatePoint(turn, pending[0], actual))
            chars_mismatches += int(pending[1] != report.sent_chars)
        calibration = calibrated_by(report, calibration)
        # The report comes after the generator stored its calibration: the gateway's
        # token_count is current now.
        session, conversation = await read_session(http, sid)
        if report.next_prompt_chars is not None:
            own = estimate_tokens(report.next_prompt_chars, calibration,
                                  report.next_prompt_messages, report.next_prompt_extra_bytes)
            gateway_deltas.append(int(session["token_count"]) - own)
        pending = None
        if turn < len(script):
            pending = fit_check_estimate(ESTIMATE_SYSTEM, conversation, script[turn],
                                         calibration)
    return points, {"sent_chars_mismatches": chars_mismatches,
                    "gateway_token_count_minus_pure": gateway_deltas}


async def estimate_live(env: Env, script: Sequence[str]) -> dict[float, Any]:
    watch = ReportWatch()
    nc = await nats.connect(env.nats_url)
    results: dict[float, Any] = {}
    try:
        await nc.subscribe(subjects.RESPONSE_GENERATION, cb=watch.on_message)
        await round_trip(nc)
        async with http_client(env, 4) as http:
            for cpt in CHARS_PER_TOKEN:
                results[cpt] = await estimate_points_live(env, http, watch, cpt, script)
    finally:
        await configure_stub(env.stub_url, chars_per_token=4.0)
        await nc.close()
    return results


def row_estimate(bench: Bench) -> Row:
    script = ESTIMATE_SCRIPT[: bench.params.estimate_turns]
    offline = {cpt: estimate_points_offline(cpt, script) for cpt in CHARS_PER_TOKEN}
    if bench.in_process:
        mode = "in-process (stand-in tokenizer, no services)"
        points = offline
        checks: dict[str, Any] = {}
    else:
        mode = "live (gateway, generator, stand-in)"
        live = asyncio.run(estimate_live(bench.plain(), script))
        points = {cpt: live[cpt][0] for cpt in CHARS_PER_TOKEN}
        checks = {str(cpt): live[cpt][1] for cpt in CHARS_PER_TOKEN}
    # The error of largest size per chars/token, with its sign (+ over-estimates).
    signed = {cpt: max((p.error_pct for p in pts), key=abs) for cpt, pts in points.items()}
    per_cpt = {cpt: abs(err) for cpt, err in signed.items()}
    worst = max(per_cpt.values())
    return Row(
        name="estimate_error", value=worst, unit="% max |error|",
        target=Target("<=", ESTIMATE_MAX_ERROR_PCT),
        detail="worst per chars/token: " + ", ".join(f"{cpt:g}: {err:+.1f}%"
                                                     for cpt, err in signed.items())
               + f" ({len(script) - 1} estimates each, {mode.split(' ')[0]})",
        raw={
            "mode": mode,
            "max_abs_error_pct_by_cpt": {str(c): e for c, e in per_cpt.items()},
            "worst_signed_error_pct_by_cpt": {str(c): e for c, e in signed.items()},
            "max_underestimate_pct": -min(min(p.error_pct for p in pts) for pts in points.values()),
            "max_overestimate_pct": max(max(p.error_pct for p in pts) for pts in points.values()),
            "points_by_cpt": {str(c): [{"turn": p.turn, "estimate": p.estimate,
                                        "actual": p.actual, "error_pct": p.error_pct}
                                       for p in pts] for c, pts in points.items()},
            "offline_max_abs_error_pct_by_cpt": {
                str(c): max(abs(p.error_pct) for p in pts) for c, pts in offline.items()},
            "checks_by_cpt": checks,
            "turns": len(script),
        },
    )
