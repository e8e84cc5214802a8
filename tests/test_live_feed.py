"""The gateway's live feed on a real NATS: it subscribes only while a page
listens, so turns nobody watches cost the gateway nothing, and a page gone
at any moment gives back its stream."""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from starlette.types import Message

from schemas import subjects
from services.gateway.live import EventStream, ListenerLimit, LiveFeed
from services.gateway.settings import GatewaySettings
from tests.events import eventually


async def state_change(nc: NATS, sid: str) -> None:
    body = {"message_type": "generator.state", "session_id": sid, "payload": {}}
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
    assert event.startswith("event: generator.state\n")
    await stream.aclose()
    await eventually(lambda: not feed.subscribed, "the feed unsubscribed")
    await feed.stop()


async def test_a_message_names_neither_its_event_nor_its_subject(nc: NATS) -> None:
    """A `message_type` with line breaks wrote a made-up compaction result
    into every page's stream, and a `subject` field hid where it came from."""
    feed = LiveFeed(nc)
    stream = feed.stream("s3")
    await anext(stream)
    forged = "x\n\nevent: compaction.result\ndata: {}"
    body = {"message_type": forged, "subject": "compaction.result", "session_id": "s3",
            "payload": {}}
    await nc.publish(subjects.COMPACTION_REQUEST, json.dumps(body).encode())
    event = await asyncio.wait_for(anext(stream), 5)
    name, data = event.removesuffix("\n\n").split("\n")
    assert name == "event: compaction.request"
    passed_on = json.loads(data.removeprefix("data: "))
    assert passed_on["subject"] == subjects.COMPACTION_REQUEST
    assert passed_on["message_type"] == forged  # as text, inside the data
    await stream.aclose()
    await feed.stop()


async def test_a_second_listener_keeps_the_subscription(nc: NATS) -> None:
    feed = LiveFeed(nc)
    first, second = feed.stream(None), feed.stream(None)
    await anext(first)
    await anext(second)
    await first.aclose()
    # Heard after the first listener left, so still subscribed then.
    await state_change(nc, "s2")
    assert (await asyncio.wait_for(anext(second), 5)).startswith("event: generator.state")
    assert feed.subscribed
    await second.aclose()
    await feed.stop()
    assert not feed.subscribed


async def test_a_listener_gone_while_subscribing_leaves_the_connection_working(
        nats_url: str) -> None:
    """A page closed the moment it opened: its stream is cancelled while the
    feed makes sure its subscriptions reached the server. nats-py's flush,
    cancelled there, left a cancelled future for the server's PONG, and
    setting its result killed the connection's read loop: every request of
    the gateway timed out from then on."""
    nc = await nats.connect(nats_url)
    try:
        feed = LiveFeed(nc)
        listening = asyncio.create_task(anext(feed.stream(None)))
        while not feed.subscribed:  # noqa: ASYNC110 - step by step, to cancel at its next await
            await asyncio.sleep(0)
        listening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listening
        async def echo(msg: Msg) -> None:
            await msg.respond(b"ok")

        answers = await nc.subscribe("feed.echo", cb=echo)
        assert (await nc.request("feed.echo", b"", timeout=5)).data == b"ok"
        await answers.unsubscribe()
        await feed.stop()
    finally:
        await nc.close()


async def gone_at_once() -> Message:
    return {"type": "http.disconnect"}


async def sent(message: Message) -> None:
    await asyncio.Event().wait()  # a write that never ends: the client is gone


# An HTTP request's scope, as uvicorn hands a response it.
SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


async def respond(response: EventStream) -> None:
    """Serve the response the way uvicorn does to a client already gone: the
    body races a disconnect that is there before its first step."""
    await response(SCOPE, gone_at_once, sent)


async def test_a_client_gone_before_the_first_byte_gives_its_share_back(nc: NATS) -> None:
    limit, feed = ListenerLimit(1), LiveFeed(nc)
    release = limit.admit("127.0.0.1")
    assert release is not None and limit.admit("127.0.0.1") is None
    await respond(EventStream(feed.stream(None), release))
    again = limit.admit("127.0.0.1")
    assert again is not None  # not held for good by a stream that never started
    again()
    again()  # a second release gives back nothing more
    assert limit.admit("127.0.0.1") is not None and limit.admit("127.0.0.1") is None


async def test_a_stream_that_started_is_closed_when_its_client_goes(nc: NATS) -> None:
    limit, feed = ListenerLimit(1), LiveFeed(nc)
    stream = feed.stream(None)
    assert await anext(stream) == ": connected\n\n"
    release = limit.admit("127.0.0.1")
    assert release is not None
    await state_change(nc, "s4")  # its next piece, which the response's headers wait for
    await respond(EventStream(stream, release))
    # Closed at once, not whenever the collector finds the generator.
    await eventually(lambda: not feed.subscribed, "the feed unsubscribed")
    await feed.stop()


async def test_the_headers_wait_until_the_stream_listens(nc: NATS) -> None:
    """A page takes the headers for "the feed is open": sent before the
    stream listened, an event published in between was lost to it."""
    feed = LiveFeed(nc)
    listening_at_headers: list[bool] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            listening_at_headers.append(feed.subscribed)
            raise ConnectionResetError  # the client goes: enough has been seen

    with contextlib.suppress(ConnectionResetError):
        await EventStream(feed.stream(None), lambda: None)(SCOPE, asyncio.Event().wait, send)
    assert listening_at_headers == [True]
    await feed.stop()


async def test_a_session_deleted_is_told_to_the_pages_showing_it(nc: NATS) -> None:
    feed = LiveFeed(nc)
    stream = feed.stream("gone")
    await anext(stream)
    body = {"message_type": "session.deleted", "session_id": "gone",
            "payload": {"session_id": "gone"}}
    await nc.publish(subjects.session_deleted("gone"), json.dumps(body).encode())
    event = await asyncio.wait_for(anext(stream), 5)
    name, data = event.removesuffix("\n\n").split("\n")
    assert name == "event: session.deleted"
    assert json.loads(data.removeprefix("data: "))["session_id"] == "gone"
    await stream.aclose()
    await feed.stop()


async def test_a_live_settings_change_reaches_every_stream_whatever_its_session(
        nc: NATS) -> None:
    feed = LiveFeed(nc)
    one, every = feed.stream("s5"), feed.stream(None)
    await anext(one)
    await anext(every)
    feed.settings_changed(GatewaySettings(compaction_threshold=0.6))
    for stream in (one, every):
        name, data = (await asyncio.wait_for(anext(stream), 5)).removesuffix("\n\n").split("\n")
        assert name == "event: settings.changed"
        assert json.loads(data.removeprefix("data: "))["payload"] == {"compaction_threshold": 0.6}
    await one.aclose()
    await every.aclose()
    await feed.stop()
