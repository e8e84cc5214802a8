"""Waiting for a query's tokens and reply in the gateway (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest

from schemas.messages import Reply, Token
from services.gateway.replies import Event, events_until_reply

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
