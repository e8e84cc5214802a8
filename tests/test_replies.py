"""Waiting for a query's tokens and reply in the gateway (pure asyncio)."""

from __future__ import annotations

import asyncio

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


async def test_a_streamed_answer_is_late_only_after_a_quiet_spell_not_in_all() -> None:
    """A slow model writing for longer than the limit, a token at a time, is
    at work: it was cut off at the limit, its answer still being written."""
    queue: asyncio.Queue[Event] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    quiet_limit_s = 1.0
    ends = loop.time() + 3 * quiet_limit_s

    async def write() -> None:
        index = 0
        while loop.time() < ends:
            queue.put_nowait(Token(session_id=SID, query_id="q", index=index, text="x"))
            index += 1
            await asyncio.sleep(quiet_limit_s / 20)
        queue.put_nowait(Reply(session_id=SID, query_id="q", reply="x" * index))

    writer = asyncio.create_task(write())
    events = [event async for event in streamed_events(queue, quiet_limit_s, 60.0)]
    await writer
    assert isinstance(events[-1], Reply) and len(events) > 20


async def test_a_quiet_stream_is_kept_alive_until_its_limit() -> None:
    queue: asyncio.Queue[Event] = asyncio.Queue()
    events = streamed_events(queue, 60.0, 0.01)
    assert await anext(events) is None  # a beat: nothing came yet
    reply = Reply(session_id=SID, query_id="q", reply="Hi")
    queue.put_nowait(reply)
    assert await anext(events) == reply
    with pytest.raises(TimeoutError):  # the limit, with beats more often than it
        async for event in streamed_events(queue, 0.05, 0.01):
            assert event is None
