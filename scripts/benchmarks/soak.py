"""Rows soak_1_generator and soak_2_generators: 64 sessions × 40 turns each,
all at once, in a window small enough that automatic compaction runs all
along. What a day of use must not show: a turn lost or answered twice (read
back from every session's full transcript), a latency that drifts, a
compaction that never completes, or memory that grows without bound (each
service's peak resident set at the end)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from scripts.benchmarks.client import Http, ask_ok, http_client, new_session
from scripts.benchmarks.harness import Env, Row, Target, running_env
from scripts.benchmarks.measure import summary_ms
from scripts.benchmarks.memory import peak_rss_kb

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

SOAK_SESSIONS = 64
SOAK_TURNS = (10, 40)  # quick, full
# A small window, as the compaction tests use: a few answers call for a compaction.
SOAK_ENV = {"NUM_CTX": "2048", "COMPACTION_TAIL_TURNS": "2"}
SOAK_ANSWER_CHARS = 1200
SERVICE_MAX_RSS_MB = 150.0


def turn_text(session: int, turn: int) -> str:
    return f"soak {session}.{turn} !long {SOAK_ANSWER_CHARS}"


async def one_session(http: Http, index: int, turns: int) -> tuple[str, list[float]]:
    """A session's turns one after the other, as a person types them."""
    sid = await new_session(http)
    latencies = []
    for turn in range(turns):
        started = time.perf_counter()
        await ask_ok(http, sid, turn_text(index, turn))
        latencies.append(time.perf_counter() - started)
    return sid, latencies


async def faults_in(http: Http, sid: str, index: int, turns: int) -> dict[str, int]:
    items = (await http.get(f"/api/sessions/{sid}/export?format=json")).json()["items"]
    return faults_of(items, index, turns)


def faults_of(items: list[dict[str, Any]], index: int, turns: int) -> dict[str, int]:
    """Turns missing from a session's transcript items, and turns found in it
    more than once (asked twice, or answered twice)."""
    messages = [item for item in items if item.get("kind") == "message"]
    asked = Counter(item["content"] for item in messages if item.get("role") == "user")
    answers = sum(1 for item in messages if item.get("role") == "assistant")
    wanted = [turn_text(index, turn) for turn in range(turns)]
    return {"lost": sum(1 for text in wanted if asked[text] == 0),
            "duplicated": sum(asked[text] - 1 for text in wanted if asked[text] > 1)
            + max(0, answers - turns)}


async def soak(env: Env, turns: int) -> dict[str, Any]:
    async with http_client(env, SOAK_SESSIONS) as http:
        started = time.perf_counter()
        done = await asyncio.gather(*(one_session(http, i, turns)
                                      for i in range(SOAK_SESSIONS)))
        seconds = time.perf_counter() - started
        faults = [await faults_in(http, sid, i, turns) for i, (sid, _) in enumerate(done)]
        records = [(await http.get(f"/api/sessions/{sid}")).json() for sid, _ in done]
    latencies = [s for _, session_latencies in done for s in session_latencies]
    return {
        "seconds": seconds, "turns": len(latencies), "latency": summary_ms(latencies),
        "lost": sum(f["lost"] for f in faults),
        "duplicated": sum(f["duplicated"] for f in faults),
        "compactions": sum(int(r.get("compactions") or 0) for r in records),
        "peak_rss_kb": peak_rss_kb(env.system),
    }


def soak_row(name: str, bench: Bench, generators: int) -> Row:
    turns = SOAK_TURNS[0] if bench.params.quick else SOAK_TURNS[1]
    with running_env(env=SOAK_ENV) as env:  # a fresh system: its peaks are this row's
        for extra in range(1, generators):
            env.system.add(f"generator-{extra + 1}", "services.generator",
                           {"GENERATOR_ID": f"soak-{extra + 1}"}).start()
        figures = asyncio.run(soak(env, turns))
    peak_mb = {service: kb / 1024 for service, kb in figures["peak_rss_kb"].items()}
    within = max(peak_mb.values()) <= SERVICE_MAX_RSS_MB
    return Row(
        name=name, value=float(figures["lost"] + figures["duplicated"]),
        unit="turns lost or duplicated", target=Target("<=", 0),
        detail=soak_text(figures, turns, generators, bench.params.quick)
        + ", ".join(f"{s} {mb:.0f} MB" for s, mb in peak_mb.items())
        + f" ({'within' if within else 'OVER'} {SERVICE_MAX_RSS_MB:.0f} MB each)",
        raw={**figures, "sessions": SOAK_SESSIONS, "turns_per_session": turns,
             "generators": generators, "peak_rss_mb": peak_mb, "rss_within_target": within,
             "service_max_rss_mb": SERVICE_MAX_RSS_MB, "env": SOAK_ENV},
    )


def soak_text(figures: dict[str, Any], turns: int, generators: int, quick: bool) -> str:
    latency = figures["latency"]
    return (f"{SOAK_SESSIONS} sessions × {turns} turns{' (--quick)' if quick else ''}, "
            f"{generators} generator(s): p50 {latency['p50_ms']:.0f} ms, p99 "
            f"{latency['p99_ms']:.0f} ms over {figures['turns']} turns, "
            f"{figures['compactions']} compactions, "
            f"{figures['turns'] / figures['seconds']:.0f} turns/s; peak RSS ")


def row_soak_1(bench: Bench) -> Row:
    return soak_row("soak_1_generator", bench, 1)


def row_soak_2(bench: Bench) -> Row:
    return soak_row("soak_2_generators", bench, 2)
