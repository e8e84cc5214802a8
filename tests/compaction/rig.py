"""What the compaction tests share: the settings of a small window (NUM_CTX
2048, budget 1792 tokens, so a few turns of `!long` answers fill it), and
the requests and waits the tests make."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import httpx
import nats
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import CompactionRequest, Level, ToolOutcome
from services.shared.bus import Bus, round_trip
from tests.events import Watcher
from tests.stub_server import running_stub
from tests.tools_offered import offer_tools

NUM_CTX = 2048
SMALL_WINDOW = {"NUM_CTX": str(NUM_CTX), "COMPACTION_TAIL_TURNS": "2",
                "COMPACTION_COOLDOWN_S": "1"}
EVENTS = (subjects.COMPACTION_REQUEST, subjects.COMPACTION_EVENT, subjects.COMPACTION_RESULT,
          f"{subjects.STATE_PREFIX}.*")
SYSTEM_PROMPT = "You are a careful assistant. Answer briefly."
# A summariser whose own window is smaller than NUM_CTX.
SMALL_WRITER_WINDOW = 2048


async def create(http: httpx.AsyncClient, **body: object) -> str:
    response = await http.post("/api/sessions", json={"system": SYSTEM_PROMPT, **body})
    return str(response.json()["session_id"])


async def chat(http: httpx.AsyncClient, sid: str, turns: int, filler: int = 300,
               start: int = 1) -> list[httpx.Response]:
    return [await http.post(f"/api/sessions/{sid}/messages",
                            json={"content": f"question {i} !long {filler}"})
            for i in range(start, start + turns)]


async def session(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    return dict((await http.get(f"/api/sessions/{sid}")).json())


def results(watcher: Watcher, sid: str) -> list[dict[str, Any]]:
    return [p for p in watcher.payloads("compaction.result") if p["session_id"] == sid]


async def next_result(watcher: Watcher, sid: str, count: int = 1) -> dict[str, Any]:
    await watcher.wait_until(lambda: len(results(watcher, sid)) >= count, 20)
    return results(watcher, sid)[count - 1]


async def serve_a_verbose_tool(nats_url: str, output: str = "line of output\n" * 150) -> Any:
    """A tool of the test's own on real NATS whose output is long."""
    nc = await nats.connect(nats_url)
    definition = [{"type": "function", "function": {
        "name": "dump", "description": "prints a lot", "parameters": {"type": "object"}}}]

    async def dump(msg: Msg) -> None:
        await msg.respond(Bus(nc, "tools").envelope(
            msg.subject, ToolOutcome(name="dump", content=output)
        ).model_dump_json().encode())

    await offer_tools(nc, definition)
    await nc.subscribe(subjects.tool("dump"), cb=dump)
    await round_trip(nc)
    return nc


async def publish_request(nats_url: str, sid: str, level: str) -> None:
    """A compaction request at a given level, as the decider sends one."""
    nc = await nats.connect(nats_url)
    try:
        await Bus(nc, "compaction-decider").js_publish(
            subjects.COMPACTION_REQUEST,
            CompactionRequest(session_id=sid, auto=True, level=Level(level),
                              reason="test"), session_id=sid)
    finally:
        await nc.drain()


def compaction_stub() -> AbstractContextManager[str]:
    """The stand-in the compaction tests talk to: its `summariser` takes 1.5 s
    a summary, and `small-writer` has a window smaller than NUM_CTX."""
    return running_stub("--model-latency", "summariser=1500",
                        "--context-length", f"small-writer={SMALL_WRITER_WINDOW}")
