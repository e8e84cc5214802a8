"""Watch NATS subjects from a test: collect decoded envelopes as they come."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import nats
from nats.aio.msg import Msg

from schemas import subjects
from services.compaction_decider.service import CONSUMER
from services.shared.bus import round_trip


class Watcher:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._arrived = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        self.events.append({"subject": msg.subject, **json.loads(msg.data)})
        self._arrived.set()

    def payloads(self, message_type: str | None = None) -> list[dict[str, Any]]:
        return [e["payload"] for e in self.events
                if message_type is None or e.get("message_type") == message_type]

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not condition():
                self._arrived.clear()
                await self._arrived.wait()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool],
                       timeout_s: float = 15.0) -> dict[str, Any]:
        await self.wait_until(lambda: any(predicate(e) for e in self.events), timeout_s)
        return next(e for e in self.events if predicate(e))


@asynccontextmanager
async def watching(nats_url: str, *subjects: str) -> AsyncIterator[Watcher]:
    nc = await nats.connect(nats_url)
    watcher = Watcher()
    for subject in subjects:
        await nc.subscribe(subject, cb=watcher.on_message)
    await round_trip(nc)
    try:
        yield watcher
    finally:
        await nc.drain()


async def turns_finished(watcher: Watcher, sid: str, turns: int,
                         timeout_s: float = 15.0) -> None:
    """Wait until `turns` turns of the session are back to idle (the reply
    reaches the caller a moment before the generator resets its state)."""
    def done() -> int:
        return sum(1 for p in watcher.payloads("generator.state")
                   if p["session_id"] == sid and p["action"] == "reset")

    await watcher.wait_until(lambda: done() >= turns, timeout_s)


def transitions(watcher: Watcher, sid: str) -> list[tuple[str, str, str]]:
    return [(p["from_state"], p["to_state"], p["action"])
            for p in watcher.payloads("generator.state") if p["session_id"] == sid]


async def server_sent_events(response: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event name, decoded data) for each event of an httpx streaming response."""
    async for event in server_sent_lines(response.aiter_lines()):
        yield event


async def server_sent_lines(lines: AsyncIterator[str]
                            ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """(event name, decoded data) for each event in the lines of an event stream."""
    name = ""
    async for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])


async def consumer_caught_up(nats_url: str, stream: str, durable: str,
                             timeout_s: float = 20.0) -> None:
    """Wait until a durable consumer has taken and settled every message so far."""
    nc = await nats.connect(nats_url)
    try:
        for _ in range(int(timeout_s / 0.05)):
            info = await nc.jetstream().consumer_info(stream, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{durable} on {stream} still busy after {timeout_s} s")
    finally:
        await nc.close()


Status = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]


async def decider_caught_up(nats_url: str, status: Status | None = None,
                            timeout_s: float = 20.0) -> None:
    """Wait until the compaction decider has judged every report so far. It
    acknowledges none, so its consumer only tells what was delivered: the
    last of those must also be the last report the decider says it judged.
    `status`: the decider's own, for one in this process; else asked over NATS."""
    nc = await nats.connect(nats_url)

    async def asked() -> dict[str, Any]:
        reply = await nc.request(subjects.service_status("compaction-decider"), b"", timeout=5)
        return dict(json.loads(reply.data))

    async def judged_all() -> bool:
        info = await nc.jetstream().consumer_info(subjects.GENERATIONS_STREAM, CONSUMER)
        current = (status or asked)()
        seen = await current if inspect.isawaitable(current) else current
        return info.num_pending == 0 and seen["last_report_seq"] == info.delivered.stream_seq

    try:
        await eventually(judged_all, "the decider judged every report", timeout_s)
    finally:
        await nc.close()


async def eventually(check: Callable[[], bool | Awaitable[bool]], what: str = "the condition",
                     timeout_s: float = 20.0) -> None:
    """Wait until `check` holds: for state another process keeps (a stand-in's
    counters, a service's status) that sends no event of its own. It is asked
    again every 20 ms, up to `timeout_s`. A check whose own request timed out
    is asked again: nats-py's timeout is a TimeoutError too, not the wait's."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                held = check()
                if await held if inspect.isawaitable(held) else held:
                    return
                await asyncio.sleep(0.02)
        except TimeoutError:
            if loop.time() >= deadline:
                raise AssertionError(f"never happened within {timeout_s:g} s: {what}") from None


def until(check: Callable[[], bool], what: str = "the condition",
          timeout_s: float = 20.0) -> None:
    """`eventually` for a test without an event loop: `check` is asked again
    every 50 ms, up to `timeout_s`. A check may raise to end the wait early
    (a process that exited, say)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s:g} s: {what}")
        time.sleep(0.05)
