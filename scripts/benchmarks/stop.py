"""Row stop_latency: from the stop asked for to the caller's `done`, over answers
the stand-in writes slowly enough never to end by themselves meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from scripts.benchmarks.client import Http, http_client, new_session
from scripts.benchmarks.harness import Env, Row, Target, running_env
from scripts.benchmarks.measure import summary_ms

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

STOP_MAX_MS = 500.0
STOP_MS_PER_TOKEN = 5.0
STOP_ROUNDS = (5, 20)  # quick, full
STOP_AFTER_TOKENS = 3


async def timed_stop(http: Http, sid: str) -> float:
    """Seconds from asking to stop a streaming answer to its `done` event:
    by then the model call has ended, its HTTP stream closed, and the
    partial answer is stored."""
    tokens, asked = 0, 0.0
    async with http.events(f"/api/sessions/{sid}/messages",
                           json={"content": "go on !long 40000"}) as events:
        async for event, data in events:
            if event == "token":
                tokens += 1
                if tokens == STOP_AFTER_TOKENS:
                    asked = time.perf_counter()
                    stop = await http.post(f"/api/sessions/{sid}/stop")
                    if stop.status_code != 202:
                        raise RuntimeError(f"stop: HTTP {stop.status_code} {stop.text}")
            elif event in ("done", "error"):
                if event != "done" or not asked or not json.loads(data).get("stopped"):
                    raise RuntimeError(f"the answer ended unstopped: {event} {data}")
                return time.perf_counter() - asked
    raise RuntimeError("the answer's stream ended without a done event")


async def timed_stops(env: Env, rounds: int) -> list[float]:
    async with http_client(env, 4) as http:
        return [await timed_stop(http, await new_session(http)) for _ in range(rounds)]


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
