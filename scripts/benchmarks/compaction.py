"""Rows compaction_latency and compaction_one_slot: what a compaction costs the
queries that arrive while it runs, as latency against a twin session never
compacted, asked at the same moments with the same history (and, in the
detail, against the same session before the compaction); in blocking mode,
how many queries were refused or delayed; and, with answers and summaries from
one model, how long an answer waits for a summary piece holding the model's
only slot.

The twin is the headline's "no compaction". Against the session's own
queries before the compaction, two things besides the compaction moved the
ratio: the history grows by a turn with each query, so later queries cost
more (the twin showed the same rise), and a spell of the machine falls on one
phase only. The twin's queries alternate with the measured ones, so both
share every moment and every history length."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import nats

from schemas import subjects
from scripts.benchmarks.client import (
    Answer,
    Http,
    ask_ok,
    http_client,
    new_session,
    timed_ask,
)
from scripts.benchmarks.harness import Env, Params, Row, Target, running_env
from scripts.benchmarks.measure import summary_ms
from scripts.ollama_stub import filler_text
from services.shared.bus import round_trip

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

SUMMARISER = "summariser"
COMPACTION_MAX_RATIO = 1.2
SUMMARY_LATENCY_S = 5.0
# compaction_one_slot: answers and summaries from one model, whose time is
# per generated token, so a summary takes seconds and an answer a tenth of one.
SHARED_MS_PER_TOKEN = 10.0
SLOTS_COMPARED = (1, 4)
# The summariser's window there: small enough that the summary takes several pieces.
SHARED_SUMMARY_NUM_CTX = 1024
# A query during a blocking compaction slower than this counts as delayed.
DELAYED_S = 1.0


@dataclass
class CompactionRun:
    baseline: list[float]
    during: list[tuple[float, float, int, str]]  # start, seconds, status, error code
    after: list[tuple[float, float, int, str]]
    compact_posted: float
    started_at: float | None
    result_at: float | None
    result: dict[str, Any] | None
    # A twin session that is never compacted, queried right after each measured query:
    # what the same moments cost without a compaction (other load on the machine
    # shows in both).
    twin_baseline: list[float]
    twin_during: list[float]


class CompactionWatch:
    """compaction.event / compaction.result of one session, with arrival times."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.started_at: float | None = None
        self.result_at: float | None = None
        self.result: dict[str, Any] | None = None
        self._changed = asyncio.Event()

    async def on_message(self, msg: Any) -> None:
        envelope = json.loads(msg.data)
        payload = envelope.get("payload", {})
        if payload.get("session_id") != self.sid:
            return
        if msg.subject == subjects.COMPACTION_EVENT and payload.get("event") == "started":
            self.started_at = self.started_at or time.perf_counter()
        elif msg.subject == subjects.COMPACTION_RESULT and self.result is None:
            self.result_at = time.perf_counter()
            self.result = payload
        self._changed.set()

    async def wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                self._changed.clear()
                await self._changed.wait()


def query_outcome(response: Answer) -> tuple[int, str]:
    if response.status_code == 200:
        return 200, ""
    try:
        code = str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        code = "?"
    return response.status_code, code


async def twin_query(http: Http, twin: str, content: str) -> float:
    _, seconds, response = await timed_ask(http, twin, content)
    if response.status_code != 200:
        raise RuntimeError(f"twin session query: HTTP {response.status_code}")
    return seconds


async def baseline_queries(http: Http, sid: str, twin: str, params: Params
                           ) -> tuple[list[float], list[float]]:
    """Some history on both sessions, then N queries without compaction, each
    followed by the same on the twin: (latencies, the twin's latencies)."""
    for index in range(params.compaction_history_turns):
        for session in (sid, twin):
            await ask_ok(http, session, f"history turn {index}: "
                         + filler_text(200, index))
    baseline, twin_baseline = [], []
    for index in range(params.compaction_queries):
        _, seconds, response = await timed_ask(http, sid, f"baseline {index}")
        if response.status_code != 200:
            raise RuntimeError(f"baseline query: HTTP {response.status_code}")
        baseline.append(seconds)
        twin_baseline.append(await twin_query(http, twin, f"baseline {index}"))
    return baseline, twin_baseline


async def queries_during(http: Http, sid: str, twin: str, params: Params
                         ) -> tuple[list[tuple[float, float, int, str]], list[float]]:
    """N queries once the compaction has started, each followed by the same on
    the twin: ((start, seconds, status, error code), the twin's latencies)."""
    during, twin_during = [], []
    for index in range(params.compaction_queries):
        start, seconds, response = await timed_ask(http, sid, f"during {index}")
        during.append((start, seconds, *query_outcome(response)))
        twin_during.append(await twin_query(http, twin, f"during {index}"))
    return during, twin_during


async def compaction_round(nc: Any, http: Http, params: Params
                           ) -> CompactionRun:
    """A session with some history; N queries without compaction; a compaction whose
    summary takes 5 s and, as soon as it has started, N more queries; then a query
    every 100 ms until the compaction's result arrives."""
    sid = await new_session(http, "You are a benchmark assistant.")
    twin = await new_session(http, "You are a benchmark assistant.")
    watch = CompactionWatch(sid)
    subs = [await nc.subscribe(subjects.COMPACTION_EVENT, cb=watch.on_message),
            await nc.subscribe(subjects.COMPACTION_RESULT, cb=watch.on_message)]
    await round_trip(nc)
    try:
        baseline, twin_baseline = await baseline_queries(http, sid, twin, params)
        posted = time.perf_counter()
        response = await http.post(f"/api/sessions/{sid}/compact")
        if response.status_code != 202:
            raise RuntimeError(f"compact: HTTP {response.status_code} {response.text}")
        await watch.wait(lambda: watch.started_at is not None or watch.result is not None,
                         15.0)
        during, twin_during = await queries_during(http, sid, twin, params)
        after = []
        while watch.result is None and time.perf_counter() - posted < 60:
            start, seconds, response = await timed_ask(http, sid, "until done")
            after.append((start, seconds, *query_outcome(response)))
            await asyncio.sleep(0.1)
        await watch.wait(lambda: watch.result is not None, 60.0)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    return CompactionRun(baseline, during, after, posted, watch.started_at, watch.result_at,
                         watch.result, twin_baseline, twin_during)


async def compaction_rounds(env: Env, params: Params, rounds: int) -> list[CompactionRun]:
    nc = await nats.connect(env.nats_url)
    try:
        async with http_client(env, 4) as http:
            return [await compaction_round(nc, http, params) for _ in range(rounds)]
    finally:
        await nc.close()


def compaction_env(params: Params, mode: str) -> dict[str, str]:
    return {
        "COMPACTION_MODEL": SUMMARISER,
        "COMPACTION_TAIL_TURNS": str(params.compaction_tail_turns),
        "COMPACTION_MODE": mode,
        "BLOCKING_QUERY_WAIT_S": "10",
        "SUMMARY_TIMEOUT_S": "60",
    }


def measure_compaction(params: Params, mode: str, rounds: int) -> list[CompactionRun]:
    flags = ("--model-latency", f"{SUMMARISER}={SUMMARY_LATENCY_S * 1000:.0f}")
    with running_env(flags, compaction_env(params, mode)) as env:
        return asyncio.run(compaction_rounds(env, params, rounds))


def describe_run(run: CompactionRun) -> dict[str, Any]:
    if run.result is None or run.result_at is None:
        return {"result_status": None}
    first_start = run.during[0][0]
    overlapping = sum(1 for start, seconds, _, _ in run.during
                      if start + seconds <= run.result_at)
    return {
        "result_status": run.result.get("status"),
        "result_error": run.result.get("error"),
        "tokens_before": run.result.get("tokens_before"),
        "tokens_after": run.result.get("tokens_after"),
        "compaction_started_after_post_s": None if run.started_at is None
        else run.started_at - run.compact_posted,
        "compaction_result_after_post_s": run.result_at - run.compact_posted,
        "result_after_first_measured_query_s": run.result_at - first_start,
        "measured_queries_finished_before_result": overlapping,
        "baseline": summary_ms(run.baseline),
        "during_compaction": summary_ms([s for _, s, _, _ in run.during]),
        "during_ms": [round(s * 1000, 2) for _, s, _, _ in run.during],
        "twin_baseline": summary_ms(run.twin_baseline),
        "twin_during_compaction": summary_ms(run.twin_during),
        "queries_until_done": len(run.after),
        "queries_until_done_latency": summary_ms([s for _, s, _, _ in run.after])
        if run.after else {},
    }


def check_background(run: CompactionRun, info: dict[str, Any]) -> None:
    """The measured queries really ran during a compaction that completed."""
    if info["result_status"] != "completed":
        raise RuntimeError(f"background compaction did not complete: {run.result}")
    if info["result_after_first_measured_query_s"] <= 0:
        raise RuntimeError("the compaction finished before the measured queries started")
    failed = [(status, code) for _, _, status, code in run.during if status != 200]
    if failed:
        raise RuntimeError(f"queries failed during the background compaction: {failed}")


def background_figures(runs: Sequence[CompactionRun]) -> dict[str, Any]:
    """Latency during background compactions against before them, and the same
    for the twin session that was not compacted, at the same moments."""
    rounds = [describe_run(run) for run in runs]
    for run, info in zip(runs, rounds, strict=True):
        check_background(run, info)
    base = summary_ms([s for run in runs for s in run.baseline])
    during = summary_ms([s for run in runs for _, s, _, _ in run.during])
    twin_base = summary_ms([s for run in runs for s in run.twin_baseline])
    twin_during = summary_ms([s for run in runs for s in run.twin_during])
    return {
        "p50_ratio": during["p50_ms"] / base["p50_ms"],
        "p99_ratio": during["p99_ms"] / base["p99_ms"],
        "baseline": base,
        "during_compaction": during,
        "overlapped": sum(info["measured_queries_finished_before_result"] for info in rounds),
        "background_rounds": rounds,
        "twin": {
            "p50_ratio": twin_during["p50_ms"] / twin_base["p50_ms"],
            "p99_ratio": twin_during["p99_ms"] / twin_base["p99_ms"],
            "baseline": twin_base,
            "during_compaction": twin_during,
            "compacting_vs_twin_p50_ratio": during["p50_ms"] / twin_during["p50_ms"],
            "compacting_vs_twin_p99_ratio": during["p99_ms"] / twin_during["p99_ms"],
        },
    }


def blocking_figures(run: CompactionRun) -> dict[str, Any]:
    """Queries during and after a blocking compaction: refused, delayed, slowest."""
    blocked = [*run.during, *run.after]
    return {
        "query_wait_s": 10,
        "queries": len(blocked),
        "rejected": sum(1 for _, _, status, _ in blocked if status != 200),
        "rejected_codes": sorted({code for _, _, status, code in blocked if status != 200}),
        "delayed": sum(1 for _, seconds, status, _ in blocked
                       if status == 200 and seconds > DELAYED_S),
        "delayed_threshold_s": DELAYED_S,
        "max_latency_s": max(seconds for _, seconds, _, _ in blocked),
        **describe_run(run),
    }


def row_compaction(bench: Bench) -> Row:
    params = bench.params
    runs = measure_compaction(params, "background", params.compaction_rounds)
    background = background_figures(runs)
    (blocking_run,) = measure_compaction(params, "blocking", 1)
    blocking = blocking_figures(blocking_run)
    base, during = background["baseline"], background["during_compaction"]
    twin = background["twin"]
    twin_during = twin["during_compaction"]
    return Row(
        name="compaction_latency",
        value=max(twin["compacting_vs_twin_p50_ratio"], twin["compacting_vs_twin_p99_ratio"]),
        unit="× twin not compacted (worse of p50, p99)",
        target=Target("<=", COMPACTION_MAX_RATIO),
        detail=f"during background compactions: p50 {during['p50_ms']:.1f} vs the twin's "
               f"{twin_during['p50_ms']:.1f} ms (×{twin['compacting_vs_twin_p50_ratio']:.2f}), "
               f"p99 {during['p99_ms']:.1f} vs {twin_during['p99_ms']:.1f} ms "
               f"(×{twin['compacting_vs_twin_p99_ratio']:.2f}), {during['n']} queries each, "
               f"{background['overlapped']}/{during['n']} done before the "
               f"{SUMMARY_LATENCY_S:g} s summaries ended ({len(runs)} compaction(s)); "
               f"against the session before: p50 ×{background['p50_ratio']:.2f} "
               f"({base['p50_ms']:.1f} ms), p99 ×{background['p99_ratio']:.2f} "
               f"({base['p99_ms']:.1f} ms), the twin's own rise meanwhile "
               f"p50 ×{twin['p50_ratio']:.2f}, p99 ×{twin['p99_ratio']:.2f}; "
               f"blocking: {blocking['rejected']} rejected, {blocking['delayed']} delayed > "
               f"{DELAYED_S:g} s of {blocking['queries']}, "
               f"max {blocking['max_latency_s']:.2f} s",
        raw={
            **{key: value for key, value in background.items() if key != "overlapped"},
            "summary_latency_s": SUMMARY_LATENCY_S,
            "history_turns": params.compaction_history_turns,
            "queries_per_phase": params.compaction_queries,
            "tail_turns": params.compaction_tail_turns,
            "blocking": blocking,
        },
    )


def measure_shared_slots(params: Params, parallel: int
                         ) -> tuple[list[CompactionRun], list[float]]:
    """Background compactions written in pieces by the model that answers, on
    a server serving `parallel` requests of it at once (OLLAMA_NUM_PARALLEL);
    with how long each piece held its slot (from the stand-in's slot log)."""
    flags = ("--parallel", str(parallel), "--ms-per-token", f"{SHARED_MS_PER_TOKEN:g}")
    env = {k: v for k, v in compaction_env(params, "background").items()
           if k != "COMPACTION_MODEL"}
    env["COMPACTION_NUM_CTX"] = str(SHARED_SUMMARY_NUM_CTX)
    with running_env(flags, env) as running:
        runs = asyncio.run(compaction_rounds(running, params, 1))
        log = httpx.get(f"{running.stub_url}/_stub/slots").json()["log"]
    return runs, summary_piece_seconds(log)


def summary_piece_seconds(log: Sequence[dict[str, Any]]) -> list[float]:
    """Slot time of each summary piece: summaries go one at a time per model,
    so each summary's slot is given back before the next one takes it."""
    taken, pieces = None, []
    for entry in log:
        if entry["kind"] != "summary":
            continue
        if entry["event"] == "started":
            taken = entry["at_s"]
        elif entry["event"] == "done" and taken is not None:
            pieces.append(entry["at_s"] - taken)
            taken = None
    return pieces


def shared_slot_figures(parallel: int, params: Params) -> dict[str, Any]:
    runs, pieces = measure_shared_slots(params, parallel)
    figures = background_figures(runs)
    if len(pieces) < 2:
        raise RuntimeError(f"the summary took {len(pieces)} piece(s), not several")
    base, during = figures["baseline"], figures["during_compaction"]
    piece_ms = 1000 * statistics.median(pieces)
    bound_ms = COMPACTION_MAX_RATIO * base["p50_ms"] + piece_ms
    return {**figures, "pieces": len(pieces), "piece_ms": piece_ms,
            "longest_piece_ms": 1000 * max(pieces), "p50_bound_ms": bound_ms,
            # What the slowest answer waited beyond a usual one: one piece at most.
            "longest_wait_ms": during["max_ms"] - base["p50_ms"],
            "p50_of_bound": during["p50_ms"] / bound_ms}


def row_compaction_one_slot(bench: Bench) -> Row:
    figures = {parallel: shared_slot_figures(parallel, bench.params)
               for parallel in SLOTS_COMPARED}
    one = figures[1]

    def text(parallel: int) -> str:
        f = figures[parallel]
        return (f"--parallel {parallel}: p50 {f['during_compaction']['p50_ms']:.0f} vs "
                f"{f['baseline']['p50_ms']:.0f} ms (×{f['p50_ratio']:.2f}), p99 "
                f"{f['during_compaction']['p99_ms']:.0f} vs {f['baseline']['p99_ms']:.0f} ms "
                f"(×{f['p99_ratio']:.2f}), longest {f['during_compaction']['max_ms']:.0f} ms "
                f"(waited {f['longest_wait_ms']:.0f}); "
                f"{f['pieces']} pieces of {f['piece_ms']:.0f} ms "
                f"(longest {f['longest_piece_ms']:.0f})")

    return Row(
        name="compaction_one_slot",
        value=one["p50_of_bound"],
        unit="of 1.2 × p50 without compaction + one piece (p50, --parallel 1)",
        target=Target("<=", 1.0),
        detail="; ".join(text(parallel) for parallel in SLOTS_COMPARED)
               + "; summaries by the answering model",
        raw={"ms_per_token": SHARED_MS_PER_TOKEN, "summary_num_ctx": SHARED_SUMMARY_NUM_CTX,
             **{f"parallel_{parallel}": f for parallel, f in figures.items()}},
    )
