"""The gateway's live feed on a real NATS: it subscribes only while a page
listens, so turns nobody watches cost the gateway nothing."""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS

from schemas import subjects
from services.gateway.live import LiveFeed
from tests.events import eventually


async def state_change(nc: NATS, sid: str) -> None:
    body = {"message_type": "state_change", "session_id": sid, "payload": {}}
    await nc.publish(subjects.state(sid), json.dumps(body).encode())


async def test_subscribed_only_while_someone_listens(nc: NATS) -> None:
    feed = LiveFeed(nc)
    await feed.start()
    assert not feed.subscribed
    stream = feed.stream("s1")
    assert await anext(stream) == ": connected\n\n"
    assert feed.subscribed
    await state_change(nc, "s1")
    event = await asyncio.wait_for(anext(stream), 5)
    assert event.startswith("event: state_change\n")
    await stream.aclose()
    await eventually(lambda: not feed.subscribed, "the feed unsubscribed")
    await feed.stop()


async def test_a_second_listener_keeps_the_subscription(nc: NATS) -> None:
    feed = LiveFeed(nc)
    first, second = feed.stream(None), feed.stream(None)
    await anext(first)
    await anext(second)
    await first.aclose()
    # Heard after the first listener left, so still subscribed then.
    await state_change(nc, "s2")
    assert (await asyncio.wait_for(anext(second), 5)).startswith("event: state_change")
    assert feed.subscribed
    await second.aclose()
    await feed.stop()
    assert not feed.subscribed
