"""The pull loop: the credit ledger by deterministic simulation of a server
that spreads messages over standing requests in any order, then the loop
itself against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StreamConfig

from services.shared.bus import round_trip
from services.shared.consumer import Credits, Delivery, PullLoop, ensure_consumer
from tests.events import eventually
from tests.nats_server import NatsServer

# --------------------------------------------------------------------------- the ledger


def test_a_fresh_ledger_asks_for_the_whole_room() -> None:
    credits = Credits()
    assert credits.wanted(5) == 5
    credits.asked(5, now=0.0)
    assert credits.wanted(5) == 0
    assert credits.wanted(7) == 2


def test_deliveries_and_an_expired_request_free_their_credit() -> None:
    credits = Credits()
    credits.asked(4, now=0.0)
    credits.delivered()
    assert credits.outstanding == 3
    credits.ended(undelivered=3)
    assert credits.outstanding == 0


def test_the_count_never_goes_below_zero() -> None:
    credits = Credits()
    credits.delivered()  # from a request given up for lost
    credits.ended(undelivered=2)
    assert credits.outstanding == 0


def test_requests_count_as_lost_only_after_the_newest_must_have_ended() -> None:
    credits = Credits(expires_s=5.0, grace_s=1.0)
    credits.asked(2, now=0.0)
    credits.asked(1, now=3.0)
    assert not credits.lost(now=8.9)  # the newest may still be standing
    assert credits.lost(now=9.1)
    credits.reset()
    assert not credits.lost(now=9.1)


def test_a_ledger_at_zero_is_never_lost() -> None:
    credits = Credits(expires_s=1.0, grace_s=0.0)
    credits.asked(1, now=0.0)
    credits.delivered()
    assert not credits.lost(now=100.0)


@dataclass
class Request:
    left: int


@pytest.mark.parametrize("seed", range(200))
def test_ledger_matches_a_server_that_spreads_messages_over_requests(seed: int) -> None:
    """Random room, arrivals, deliveries to any standing request, expiries:
    the ledger always equals what the simulated server still owes."""
    rng = random.Random(seed)
    credits, standing, room = Credits(), list[Request](), rng.randint(1, 8)
    for _ in range(300):
        step = rng.random()
        if step < 0.3:
            ask = credits.wanted(room)
            if ask:
                credits.asked(ask, now=0.0)
                standing.append(Request(ask))
        elif step < 0.7 and standing:
            request = rng.choice(standing)  # the server may serve any of them
            request.left -= 1
            credits.delivered()
            if request.left == 0:
                standing.remove(request)  # filled: ends without a word
        elif step < 0.8 and standing:
            expired = standing.pop(rng.randrange(len(standing)))
            credits.ended(undelivered=expired.left)
        else:
            room = rng.randint(0, 8)
        assert credits.outstanding == sum(r.left for r in standing)
        assert credits.outstanding <= max(room, credits.outstanding)


# --------------------------------------------------------------------------- the loop

STREAM = "PULLTEST"


def stream_of(name: str) -> str:
    return f"{STREAM}_{name}"


async def nothing_standing(nc: NATS, stream: str) -> bool:
    return (await nc.jetstream().consumer_info(stream, "worker")).num_waiting == 0


async def fresh_stream(nc: NATS, name: str) -> str:
    js = nc.jetstream()
    subject = f"pulltest.{name}"
    stream = stream_of(name)
    await js.add_stream(StreamConfig(name=stream, subjects=[subject],
                                     retention=RetentionPolicy.WORK_QUEUE))
    await ensure_consumer(nc, stream, ConsumerConfig(
        durable_name="worker", filter_subject=subject, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30))
    return subject


class Holder:
    """Keeps what it is handed until told to let go: room is what it holds."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.held: list[Msg] = []
        self.seen: list[bytes] = []
        self.arrived = asyncio.Event()

    def capacity(self) -> int:
        return self.room - len(self.held)

    async def on_message(self, msg: Msg) -> None:
        self.held.append(msg)
        self.seen.append(msg.data)
        self.arrived.set()

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.seen) < count:
                self.arrived.clear()
                await self.arrived.wait()


@contextlib.asynccontextmanager
async def pulling(nc: NATS, name: str, holder: Holder, **options: float
                  ) -> AsyncIterator[tuple[str, PullLoop]]:
    """A fresh stream's subject, and a running loop handing its messages to `holder`."""
    subject = await fresh_stream(nc, name)
    loop = PullLoop(nc, stream_of(name), "worker", holder.on_message, holder.capacity,
                    **options)
    await loop.start()
    try:
        yield subject, loop
    finally:
        await loop.stop()


async def test_never_more_in_hand_than_room_and_every_message_once(nc: NATS) -> None:
    holder = Holder(room=3)
    async with pulling(nc, "room", holder) as (subject, loop):
        for index in range(10):
            await nc.jetstream().publish(subject, str(index).encode())
        await holder.wait_for(3)
        # With no pull request standing nothing more can come: a loop that
        # over-asks would have had more handed out.
        await eventually(lambda: nothing_standing(nc, stream_of("room")),
                         "no pull request standing")
        assert len(holder.seen) == 3
        while len(holder.seen) < 10:
            for msg in holder.held:
                await msg.ack()
            holder.held.clear()
            loop.room_freed()
            await holder.wait_for(min(10, len(holder.seen) + 1))
        assert sorted(holder.seen, key=int) == [str(i).encode() for i in range(10)]


async def test_the_loop_keeps_pulling_after_its_requests_expire(nc: NATS) -> None:
    holder = Holder(room=2)
    requests = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{stream_of('expiry')}.worker")
    async with pulling(nc, "expiry", holder, expires_s=0.3) as (subject, _):
        for _ in range(3):  # each asked for once the one before ended unfilled
            await requests.next_msg(timeout=10)
        await nc.jetstream().publish(subject, b"late")
        await holder.wait_for(1, timeout_s=10.0)
        assert holder.seen == [b"late"]


async def test_a_lingering_loop_takes_what_waits_in_one_request(nc: NATS) -> None:
    """One message asked for while the stream looks quiet; once one arrives,
    all the others it says are waiting in one request, and after the last a
    pause before asking for one again."""
    subject = await fresh_stream(nc, "linger")
    for index in range(10):
        await nc.jetstream().publish(subject, str(index).encode())
    requests = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{stream_of('linger')}.worker")
    await round_trip(nc)
    seen: list[bytes] = []

    async def handle(msg: Msg) -> None:
        seen.append(msg.data)
        await msg.ack()

    loop = PullLoop(nc, stream_of("linger"), "worker", handle, linger_s=0.05)
    await loop.start()
    try:
        batches = [json.loads((await requests.next_msg(timeout=10)).data)["batch"]
                   for _ in range(3)]
    finally:
        await loop.stop()
    assert batches == [1, 9, 1]
    assert seen == [str(i).encode() for i in range(10)]


async def test_the_loop_pulls_again_after_the_server_restarts(
        private_nats: NatsServer) -> None:
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await nats.connect(private_nats.url, reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1, reconnected_cb=on_reconnect)
    try:
        holder = Holder(room=2)
        async with pulling(nc, "restart", holder, expires_s=600.0) as (subject, _):
            private_nats.restart()
            async with asyncio.timeout(10):
                await reconnected.wait()
            await nc.jetstream().publish(subject, b"after")
            # Well inside the 600 s the requests lost with the old connection
            # would take to expire.
            await holder.wait_for(1, timeout_s=60.0)
    finally:
        await nc.close()


async def test_a_loop_renewed_on_its_consumer_made_anew_pulls_at_once(nc: NATS) -> None:
    """What a service does once NATS is back without its store: the consumer
    is made again and the loop asks afresh, not once its requests expire."""
    holder = Holder(room=2)
    async with pulling(nc, "renew", holder, expires_s=600.0) as (subject, loop):
        js, stream = nc.jetstream(), stream_of("renew")
        config = (await js.consumer_info(stream, "worker")).config
        await js.delete_consumer(stream, "worker")
        assert await ensure_consumer(nc, stream, config)  # made anew
        assert not await ensure_consumer(nc, stream, config)  # there already
        loop.renew()
        await js.publish(subject, b"after")
        # Well inside the 600 s the requests standing on the old consumer
        # would take to expire.
        await holder.wait_for(1, timeout_s=60.0)
        assert holder.seen == [b"after"]


async def test_stopping_hands_over_what_has_already_arrived(nc: NATS) -> None:
    subject = await fresh_stream(nc, "stop")
    gate, seen = asyncio.Event(), list[bytes]()

    async def slow_inline(msg: Msg) -> None:
        await gate.wait()  # a handler still busy when the stop comes
        seen.append(msg.data)
        await msg.ack()

    loop = PullLoop(nc, stream_of("stop"), "worker", slow_inline, lambda: 2)
    await loop.start()
    for data in (b"first", b"second"):
        await nc.jetstream().publish(subject, data)
    async def both_delivered() -> bool:  # one in the handler, one waiting
        info = await nc.jetstream().consumer_info(stream_of("stop"), "worker")
        return info.num_ack_pending == 2

    await eventually(both_delivered, "both messages delivered")
    stopping = asyncio.create_task(loop.stop())
    await asyncio.sleep(0)  # the stop begins (its drain is under way) before the handler ends
    gate.set()
    await stopping
    assert seen == [b"first", b"second"]


async def test_a_message_that_claims_a_status_header_is_still_a_message(nc: NATS) -> None:
    holder = Holder(room=2)
    async with pulling(nc, "forged", holder) as (subject, _):
        await nc.jetstream().publish(subject, b"query", headers={
            "Status": "408", "Nats-Pending-Messages": "2"})
        await holder.wait_for(1, timeout_s=10.0)
        assert holder.seen == [b"query"]


async def test_a_changed_ack_wait_reaches_the_existing_consumer(nc: NATS) -> None:
    """Raising QUERY_ACK_WAIT_S must reach the server, or the heartbeats (a third
    of the new setting apart) come too late for the old ack wait."""
    subject = await fresh_stream(nc, "ackwait")
    stream, js = stream_of("ackwait"), nc.jetstream()
    config = ConsumerConfig(durable_name="worker", filter_subject=subject,
                            ack_policy=AckPolicy.EXPLICIT, ack_wait=120, max_ack_pending=500)
    await ensure_consumer(nc, stream, config)
    info = await js.consumer_info(stream, "worker")
    assert (info.config.ack_wait, info.config.max_ack_pending) == (120, 500)
    assert info.config.filter_subject == subject
    await ensure_consumer(nc, stream, config)  # unchanged: nothing to do
    assert (await js.consumer_info(stream, "worker")).config.ack_wait == 120


async def test_a_consumer_with_another_ack_policy_is_made_again_after_its_last_delivery(
        nc: NATS) -> None:
    """The server will not change an existing consumer's ack policy; a new
    version choosing another takes over where the old consumer stood: no
    message it delivered comes again, none after it is skipped."""
    js, stream, subject = nc.jetstream(), stream_of("policy"), "pulltest.policy"
    await js.add_stream(StreamConfig(name=stream, subjects=[subject]))
    explicit = ConsumerConfig(durable_name="worker", filter_subject=subject,
                              ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    await ensure_consumer(nc, stream, explicit)
    for data in (b"one", b"two", b"three"):
        await js.publish(subject, data)
    old = await js.pull_subscribe_bind("worker", stream=stream)
    first, _second = await old.fetch(2)
    await first.ack()  # the second delivered, never acknowledged
    await old.unsubscribe()
    await js.publish(subject, b"four")

    assert await ensure_consumer(nc, stream, explicit.evolve(ack_policy=AckPolicy.NONE))
    assert (await js.consumer_info(stream, "worker")).config.ack_policy == AckPolicy.NONE
    new = await js.pull_subscribe_bind("worker", stream=stream)
    assert [m.data for m in await new.fetch(2)] == [b"three", b"four"]


async def test_a_consumer_that_delivered_nothing_is_made_again_without_replaying(
        nc: NATS) -> None:
    js, stream, subject = nc.jetstream(), stream_of("unused"), "pulltest.unused"
    await js.add_stream(StreamConfig(name=stream, subjects=[subject]))
    await js.publish(subject, b"before")
    await ensure_consumer(nc, stream, ConsumerConfig(
        durable_name="worker", filter_subject=subject, ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.NEW))
    await js.publish(subject, b"after")
    assert await ensure_consumer(nc, stream, ConsumerConfig(
        durable_name="worker", filter_subject=subject, ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.NEW))
    new = await js.pull_subscribe_bind("worker", stream=stream)
    assert [m.data for m in await new.fetch(1)] == [b"after"]


async def test_a_message_handed_back_with_a_delay_comes_back_after_the_delay(
        nc: NATS) -> None:
    """The handler still works on (its lock's release, say) after handing the
    message back: no heartbeat may follow the `-NAK`, or the server waits a
    whole ack wait (30 s here) instead of the delay."""
    subject = await fresh_stream(nc, "handback")
    js = nc.jetstream()
    sub = await js.pull_subscribe(subject, durable="worker", stream=stream_of("handback"))
    await js.publish(subject, b"query")
    [msg] = await sub.fetch(1, timeout=5)
    delivery = Delivery(msg, heartbeat_s=0.02)
    await delivery.nak(delay_s=0.2)
    try:
        [again] = await sub.fetch(1, timeout=10)  # well within the ack wait
    finally:
        delivery.stop_heartbeat()  # the handler ends only now
    assert again.metadata.sequence.stream == msg.metadata.sequence.stream
    assert again.metadata.num_delivered == 2
    assert await Delivery(again, heartbeat_s=10).ack_confirmed(timeout_s=5)


async def test_letting_go_while_nats_stalls_leaves_the_connection_working(
        private_nats: NatsServer) -> None:
    """NATS stops answering, its socket open (paused), while a loop lets go of
    its inbox. nats-py's drain, cut short by the time limit, left a flush
    waiting, whose PONG, when NATS answered again, ended the connection's read
    loop: nothing was received any more. And the inbox stayed subscribed."""
    nc = await nats.connect(private_nats.url)
    try:
        await fresh_stream(nc, "stall")
        subscribed = set(nc._subs)
        holder = Holder(room=2)
        loop = PullLoop(nc, stream_of("stall"), "worker", holder.on_message, holder.capacity)
        await loop.start()
        private_nats.signal(signal.SIGSTOP)
        try:
            await loop.stop()
        finally:
            private_nats.signal(signal.SIGCONT)
        await round_trip(nc, timeout_s=10)  # the connection still receives
        assert set(nc._subs) == subscribed
    finally:
        await nc.close()
