"""Waiting for a query's tokens and reply in the gateway (pure asyncio)."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from schemas.messages import Reply, Token
from services.gateway.replies import Event, events_until_reply, streamed_events

SID = "s1"


async def test_tokens_then_the_reply_and_nothing_after() -> None:
    queue: asyncio.Queue[Event] = asyncio.Queue()
    token = Token(session_id=SID, query_id="q", index=0, text="Hi")
    reply = Reply(session_id=SID, query_id="q", reply="Hi")
    for event in (token, reply, token):
        queue.put_nowait(event)
    assert [event async for event in events_until_reply(queue, 1.0)] == [token, reply]


async def test_a_deadline_passing_while_the_caller_sends_a_token_ends_in_timeout() -> None:
    """The caller is busy with a token when the deadline passes: its own work is
    not cancelled, and the next wait raises TimeoutError (the stream's `error`)."""
    queue: asyncio.Queue[Event] = asyncio.Queue()
    queue.put_nowait(Token(session_id=SID, query_id="q", index=0, text="Hi"))
    sent = []
    with pytest.raises(TimeoutError):
        async for event in events_until_reply(queue, 0.05):
            await asyncio.sleep(0.15)  # sending it to a slow client
            sent.append(event)
    assert len(sent) == 1


class JumpingSelector(selectors.DefaultSelector):
    """Never waits: where its loop would wait for its next timer, the loop's
    clock jumps to it."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if not ready and timeout:
            self._loop.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a clock of its own: timeouts and keep-alives are
    judged as on the wall clock, but no stall of the machine can move them."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(JumpingSelector(self))

    def time(self) -> float:
        return self.now


def on_virtual_time(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()


async def elapse(seconds: float) -> None:
    """Until the loop's clock has moved on by `seconds`."""
    loop = asyncio.get_running_loop()
    passed = loop.create_future()
    loop.call_later(seconds, passed.set_result, None)
    await passed


def test_a_streamed_answer_is_late_only_after_a_quiet_spell_not_in_all() -> None:
    """A slow model writing for longer than the limit, a token at a time, is
    at work: it was cut off at the limit, its answer still being written."""
    async def scenario() -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()

        async def write() -> None:
            for index in range(30):  # a token every 0.3 s: 9 s in all, against 1 s of quiet
                queue.put_nowait(Token(session_id=SID, query_id="q", index=index, text="x"))
                await elapse(0.3)
            queue.put_nowait(Reply(session_id=SID, query_id="q", reply="x" * 30))

        writer = asyncio.create_task(write())
        events = [event async for event in streamed_events(queue, 1.0, 60.0)]
        await writer
        assert isinstance(events[-1], Reply) and len(events) == 31
        assert asyncio.get_running_loop().time() >= 9.0
    on_virtual_time(scenario)


def test_a_quiet_stream_is_kept_alive_until_its_limit() -> None:
    async def scenario() -> None:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        events = streamed_events(queue, 60.0, 15.0)
        assert await anext(events) is None  # a beat: nothing came in 15 s
        reply = Reply(session_id=SID, query_id="q", reply="Hi")
        queue.put_nowait(reply)
        assert await anext(events) == reply
        beats = 0
        with pytest.raises(TimeoutError):  # the limit, with beats more often than it
            async for event in streamed_events(queue, 60.0, 15.0):
                assert event is None
                beats += 1
        assert beats == 3  # at 15, 30 and 45 s; the limit at 60
    on_virtual_time(scenario)
