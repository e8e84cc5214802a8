"""Row turn_timeline: where one turn's time goes, read off the bus the way
any watcher could read it.

Every envelope carries the moment it was made. For each turn of one session
the row takes the query's, the generator's state changes', the reply's and
the report's, and sets them between the moment the driver sent the HTTP
request and the moment it had the answer. All are read from one clock (the
machine's), so the gaps between them are the turn's steps:

- intake: the gateway reads, checks and wraps the request;
- to_lock: the query is delivered, the first model call sent (the head
  start) and the session's lock taken;
- under_lock: the history and the session's record are read;
- model: the rest of the wait for the model's answer;
- storing: the turn is appended to the history;
- replying: the reply is built;
- to_caller: the reply reaches the gateway and the caller.

No target: a map for whoever works on the turn's speed. The watching
connection adds a few deliveries a turn to the server's work, so the total
runs a little above `turn_overhead`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from datetime import datetime
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from schemas import subjects
from scripts.benchmarks.bus import watching_bus
from scripts.benchmarks.client import ask, http_client, new_session
from scripts.benchmarks.harness import Env, Row
from scripts.benchmarks.measure import percentile
from services.shared.bus import parse_json

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

TIMED_TURNS = 200
# The marks of one turn in the order they happen, and the steps between them.
STEPS = (
    ("intake", "sent", "query"),
    ("to_lock", "query", "receiving"),
    ("under_lock", "receiving", "generating"),
    ("model", "generating", "publishing"),
    ("storing", "publishing", "idle"),
    ("replying", "idle", "reply"),
    ("to_caller", "reply", "answered"),
)
Marks = dict[str, float]


class Watcher:
    """Each turn's marks by correlation id: when its envelopes were made."""

    def __init__(self) -> None:
        self.marks: defaultdict[str, Marks] = defaultdict(dict)

    async def on_message(self, msg: Msg) -> None:
        self.take(msg.data)

    def take(self, data: bytes) -> None:
        env = parse_json(data)
        name = env["payload"].get("to_state") or env["message_type"].rpartition(".")[2]
        made = datetime.fromisoformat(env["timestamp"]).timestamp()
        # A query delivered twice would show some steps twice: the first try's are kept.
        self.marks[env["correlation_id"]].setdefault(name, made)


async def timed_turns(env: Env, turns: int) -> tuple[list[Marks], int]:
    """`turns` questions asked one after another in one session, each with
    the marks the bus showed for it; and how many of them failed."""
    watcher, driver, failed = Watcher(), [], 0
    async with http_client(env, 2) as http:
        sid = await new_session(http)
        await ask(http, sid, "warm-up")  # the session's first turn reads it all
        watched = (subjects.query(sid), subjects.state(sid), subjects.reply(sid),
                   subjects.RESPONSE_GENERATION)
        async with watching_bus(env.nats_url, watched, watcher.on_message):
            for index in range(turns):
                sent = time.time()
                answer = await ask(http, sid, f"timeline question {index}")
                driver.append({"sent": sent, "answered": time.time()})
                failed += answer.status_code != 200
    return joined(driver, watcher.marks), failed


def joined(driver: list[Marks], by_turn: dict[str, Marks]) -> list[Marks]:
    """The driver's marks and the bus's, turn by turn: the turns were asked
    one after another, so their queries were made in the same order."""
    bus = sorted((marks for marks in by_turn.values() if "query" in marks),
                 key=lambda marks: marks["query"])
    if len(bus) != len(driver):
        raise RuntimeError(f"saw {len(bus)} queries on the bus for {len(driver)} turns")
    return [{**asked, **seen} for asked, seen in zip(driver, bus, strict=True)]


def step_summary(turns: list[Marks]) -> dict[str, dict[str, float]]:
    """p50 and p99 of each step, in ms, over the turns that show both its marks."""
    summary: dict[str, dict[str, float]] = {}
    for step, start, end in (*STEPS, ("report_after_reply", "reply", "generation")):
        gaps = sorted((t[end] - t[start]) * 1000 for t in turns if start in t and end in t)
        if gaps:
            summary[step] = {"p50_ms": percentile(gaps, 50), "p99_ms": percentile(gaps, 99),
                             "n": len(gaps)}
    return summary


def row_turn_timeline(bench: Bench) -> Row:
    env = bench.plain()
    turns, failed = asyncio.run(timed_turns(env, TIMED_TURNS))
    steps = step_summary(turns)
    total = percentile(sorted((t["answered"] - t["sent"]) * 1000 for t in turns), 50)
    detail = ", ".join(f"{step} {steps[step]['p50_ms']:.2f}" for step, _, _ in STEPS
                       if step in steps)
    return Row(
        name="turn_timeline", value=total, unit="ms a turn (p50), by step", target=None,
        detail=f"{detail} (ms, p50 over {len(turns)} turns; {failed} failed)",
        raw={"steps": steps, "turns": len(turns), "failed": failed},
    )
