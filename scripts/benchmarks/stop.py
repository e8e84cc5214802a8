"""Row stop_latency: from the stop asked for to the caller's `done`, over answers
the stand-in writes slowly enough never to end by themselves meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import aiohttp

from scripts.benchmarks.harness import Env, Row, Target, running_env
from scripts.benchmarks.measure import summary_ms

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

STOP_MAX_MS = 500.0
STOP_MS_PER_TOKEN = 5.0
STOP_ROUNDS = (5, 20)  # quick, full
STOP_AFTER_TOKENS = 3
# The gateway refuses a write without a JSON content type, body or not.
JSON = {"Content-Type": "application/json"}


async def timed_stop(session: aiohttp.ClientSession, sid: str) -> float:
    """Seconds from asking to stop a streaming answer to its `done` event:
    by then the model call has ended, its HTTP stream closed, and the
    partial answer is stored."""
    tokens, asked = 0, 0.0
    event = ""
    async with session.post(f"/api/sessions/{sid}/messages",
                            json={"content": "go on !long 40000"},
                            headers={"accept": "text/event-stream"}) as response:
        async for raw in response.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                tokens += 1
                if tokens == STOP_AFTER_TOKENS:
                    asked = time.perf_counter()
                    async with session.post(f"/api/sessions/{sid}/stop", headers=JSON) as stop:
                        if stop.status != 202:
                            raise RuntimeError(f"stop: HTTP {stop.status} {await stop.text()}")
            elif line.startswith("data: ") and event in ("done", "error"):
                if event != "done" or not asked or not json.loads(line[6:]).get("stopped"):
                    raise RuntimeError(f"the answer ended unstopped: {event} {line}")
                return time.perf_counter() - asked
    raise RuntimeError("the answer's stream ended without a done event")


async def timed_stops(env: Env, rounds: int) -> list[float]:
    timeout = aiohttp.ClientTimeout(total=120.0)
    async with aiohttp.ClientSession(base_url=env.base_url, timeout=timeout) as session:
        times = []
        for _ in range(rounds):
            async with session.post("/api/sessions", json={}) as created:
                sid = str((await created.json())["session_id"])
            times.append(await timed_stop(session, sid))
        return times


def row_stop_latency(bench: Bench) -> Row:
    rounds = STOP_ROUNDS[0] if bench.params.quick else STOP_ROUNDS[1]
    with running_env(("--ms-per-token", f"{STOP_MS_PER_TOKEN:g}")) as running:
        times = asyncio.run(timed_stops(running, rounds))
    figures = summary_ms(times)
    return Row(
        name="stop_latency", value=max(times) * 1000, unit="ms (max)",
        target=Target("<=", STOP_MAX_MS),
        detail=f"stop asked → done with the partial answer stored: p50 "
               f"{figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms over {len(times)} "
               f"stops, each after {STOP_AFTER_TOKENS} tokens",
        raw={**figures, "stops": len(times), "ms_per_token": STOP_MS_PER_TOKEN},
    )
