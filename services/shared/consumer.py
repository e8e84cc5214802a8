"""Messages from a durable JetStream pull consumer, handed over the moment
they arrive, with never more of them in hand than the service has room for.

The loop keeps pull requests standing on the server for exactly the room the
service has (its `capacity`), delivering to an inbox subscription of its own,
and passes each message on as it lands. nats-py's `fetch` works in batches
instead: every call first asks the server what is waiting and waits for the
answer, a round trip even when messages are already there, and a message that
arrives while the service handles one batch waits for the next call. With two
generators sharing the queries that cost about a tenth of the throughput in
`scripts/bench.py`.

A pull request ends either when all its messages are delivered or when it
expires, and then the server says how many it did not deliver. The `Credits`
ledger counts the messages asked for and not yet delivered from those two
facts alone, which holds however the server spreads messages over our
standing requests. Requests lost with a connection end without a word: after
a reconnect, or once the newest request must have ended and the count is
still not zero, the loop moves to a fresh inbox (so nothing standing on the
old one can still deliver) and asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, ConsumerInfo, DeliverPolicy, Header
from nats.js.errors import NotFoundError

from services.shared.bus import round_trip

log = structlog.get_logger()
# How long a pull request stands on the server before it ends unfilled.
REQUEST_EXPIRES_S = 5.0
# After the newest request's expiry, how long its end may take to reach us.
END_GRACE_S = 1.0
# How often the loop checks the ledger against lost requests.
WATCHDOG_S = 1.0
# How long handing over what already arrived may take when letting go.
LET_GO_S = 3.0
PENDING_MESSAGES = "Nats-Pending-Messages"


class Credits:
    """Messages asked for and not yet delivered, on every standing request."""

    def __init__(self, expires_s: float = REQUEST_EXPIRES_S, grace_s: float = END_GRACE_S
                 ) -> None:
        self.expires_s = expires_s
        self._grace_s = grace_s
        self.outstanding = 0
        self._all_ended_by = 0.0

    def wanted(self, room: int) -> int:
        """How many more to ask for so that the asked-for fill the room."""
        return max(0, room - self.outstanding)

    def asked(self, count: int, now: float) -> None:
        self.outstanding += count
        self._all_ended_by = now + self.expires_s + self._grace_s

    def delivered(self) -> None:
        # Never below zero: a request given up for lost may still deliver.
        self.outstanding = max(0, self.outstanding - 1)

    def ended(self, undelivered: int) -> None:
        self.outstanding = max(0, self.outstanding - undelivered)

    def lost(self, now: float) -> bool:
        """Every request must have ended by now, yet some count is left."""
        return self.outstanding > 0 and now > self._all_ended_by

    def reset(self) -> None:
        self.outstanding = 0


# What a service's settings may change between two starts of a durable consumer.
UPDATABLE = ("ack_wait", "max_ack_pending")
# What the server refuses to change on an existing consumer; a new version of
# a service may still choose otherwise (see `_made_again`).
FIXED = ("ack_policy",)


async def ensure_consumer(nc: NATS, stream: str, config: ConsumerConfig) -> bool:
    """Create the durable consumer unless it exists, and bring its updatable
    limits to this process's settings: every process sharing it asks, and the
    server keeps one (the last started sets the limits). True when it was
    created (after a lost store, a loop on it must `renew`)."""
    js = nc.jetstream()
    assert config.durable_name
    try:
        info = await js.consumer_info(stream, config.durable_name)
    except NotFoundError:
        await js.add_consumer(stream, config=config)
        return True
    if any(getattr(config, name) != getattr(info.config, name) for name in FIXED):
        await _made_again(js, stream, config, info)
        return True
    changed = {name: getattr(config, name) for name in UPDATABLE
               if getattr(config, name) is not None
               and getattr(config, name) != getattr(info.config, name)}
    if changed:
        # Creating an existing durable with new editable fields updates it.
        await js.add_consumer(stream, config=info.config.evolve(**changed))
        log.info("consumer_updated", stream=stream, consumer=config.durable_name, **changed)
    return False


async def _made_again(js: JetStreamContext, stream: str, config: ConsumerConfig,
                      old: ConsumerInfo) -> None:
    """A consumer an earlier version made with a setting the server will not
    change: made anew, starting just after the last message the old one
    delivered, so the switch neither replays nor skips anything (a message
    delivered and not yet acknowledged is taken as handled)."""
    assert config.durable_name
    start = old.delivered.stream_seq + 1 if old.delivered else 1
    await js.delete_consumer(stream, config.durable_name)
    await js.add_consumer(stream, config=config.evolve(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
        opt_start_time=None))
    log.info("consumer_made_again", stream=stream, consumer=config.durable_name,
             ack_policy=str(config.ack_policy), start_seq=start)


class PullLoop:
    def __init__(self, nc: NATS, stream: str, durable: str,
                 on_message: Callable[[Msg], Awaitable[None]],
                 capacity: Callable[[], int] = lambda: 64,
                 expires_s: float = REQUEST_EXPIRES_S, linger_s: float = 0.0) -> None:
        """`linger_s` > 0 trades that much delay for fewer wake-ups: see `_lingered`."""
        self._nc = nc
        self._linger_s = linger_s
        # Lingering: what the last delivery said still waits, and when to ask next.
        self._waiting = 0
        self._ask_at = 0.0
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._name = durable
        self._on_message = on_message
        self._capacity = capacity
        self._credits = Credits(expires_s)
        self._sub: Subscription | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._reconnects = 0
        self._task: asyncio.Task[None] | None = None
        # Inboxes let go of whose deliveries are still being handed over.
        self._handing_over: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self._listen()
        self._task = asyncio.create_task(self._run())

    async def _listen(self) -> None:
        """Requests deliver to a fresh inbox of ours: those standing on an old
        one (before a reconnect) have no one listening, so the server skips them."""
        await self._let_go()
        if self._stopping:
            return
        self._reconnects = self._nc.stats["reconnects"]
        self._credits.reset()
        self._sub = await self._nc.subscribe(self._nc.new_inbox(), cb=self._on_delivery)

    def room_freed(self) -> None:
        self._wake.set()

    def renew(self) -> None:
        """The consumer was made anew (NATS came back without it): ask again
        at once on a fresh inbox, as after a reconnect, instead of waiting for
        requests refused before it existed to be given up for lost."""
        self._reconnects = -1
        self._wake.set()

    async def stop(self) -> None:
        # The loop first (it asks for nothing more once stopping, and may be
        # letting go of an inbox itself), then the inbox.
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        await self._let_go()

    async def _let_go(self) -> None:
        """Stop the deliveries to our inbox (the server skips requests nobody
        listens to), handing over first what has already arrived: dropped,
        it would wait out the consumer's ack wait before anyone saw it.

        Not nats-py's `drain()`: it flushes, and a flush cut short by a time
        limit, with NATS stalled, ends the connection's read loop when the
        PONG comes at last (`bus.round_trip`); the drain also leaves its
        subscription behind, made again on every reconnect."""
        sub, self._sub = self._sub, None
        if sub is None:
            return
        reconnects = self._nc.stats["reconnects"]
        # NATS away: nothing more can come on the lost connection, and the
        # server forgets the inbox by itself; a round trip would only wait.
        if self._nc.is_connected:
            with contextlib.suppress(Exception):
                await self._nc._send_unsubscribe(sub._id)
                await round_trip(self._nc, LET_GO_S)  # what came before the unsubscribe is in
        self._nc._remove_sub(sub._id)
        if self._nc.stats["reconnects"] != reconnects:  # subscribed again on the way back
            with contextlib.suppress(Exception):
                await self._nc._send_unsubscribe(sub._id)
        task = asyncio.create_task(self._hand_over(sub))
        self._handing_over.add(task)
        task.add_done_callback(self._handing_over.discard)
        # One inbox's deliveries at a time reach the handler, as before a let-go;
        # a handler still busy after the bound goes on, not cut short.
        await asyncio.wait({task}, timeout=LET_GO_S)

    @staticmethod
    async def _hand_over(sub: Subscription) -> None:
        """Each delivery that arrived goes to its handler, then the inbox's
        reader stops (a handler busy meanwhile is not cut short)."""
        try:
            await sub._pending_queue.join()
        finally:
            sub._stop_processing()

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._check_for_lost_requests()
                await self._linger()
                await self._ask_for_room()
            except Exception as err:  # NATS away: nats-py reconnects, we ask again
                log.warning("pull_request_failed", consumer=self._name, error=str(err))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCHDOG_S):
                    await self._wake.wait()
            self._wake.clear()

    async def _check_for_lost_requests(self) -> None:
        if self._nc.stats["reconnects"] == self._reconnects and not self._credits.lost(
                time.monotonic()):
            return
        if self._credits.outstanding:
            log.info("pull_requests_lost", consumer=self._name,
                     outstanding=self._credits.outstanding)
        await self._listen()

    async def _linger(self) -> None:
        delay = self._ask_at - time.monotonic()
        if delay > 0 and not self._stopping:
            await asyncio.sleep(delay)

    def _lingered(self, room: int) -> int:
        """How many to ask for when lingering. One message at a time while the
        stream is quiet, each woken for; but after one, a pause, and then all
        that came meanwhile in one request, known from the last delivery's
        count of messages still waiting: a burst read in one wake-up. Nothing
        while a request stands, so no request is left standing half filled."""
        if self._credits.outstanding:
            return 0
        return min(room, max(1, self._waiting))

    async def _ask_for_room(self) -> None:
        count = self._credits.wanted(self._capacity())
        if self._linger_s:
            count = self._lingered(count)
        if count <= 0 or self._stopping or not self._nc.is_connected:
            return
        assert self._sub is not None
        request = {"batch": count, "expires": int(self._credits.expires_s * 1e9)}
        self._credits.asked(count, time.monotonic())
        await self._nc.publish(self._next_subject, json.dumps(request).encode(),
                               reply=self._sub.subject)

    async def _on_delivery(self, msg: Msg) -> None:
        # Stored messages come with a subject to acknowledge on, the server's
        # status messages without; a header alone could be forged by whoever
        # published the message.
        if msg.reply:
            self._credits.delivered()
            if self._linger_s:
                self._waiting = msg.metadata.num_pending
                self._ask_at = time.monotonic() + (0 if self._waiting else self._linger_s)
            await self._on_message(msg)
            # A handler that finished inline left room; ask once half of it
            # is free rather than once per message.
            if self._credits.outstanding <= self._capacity() // 2:
                self._wake.set()
            return
        # The request ended (expired, or the server gave up on it): what it did
        # not deliver is no longer on the way.
        headers = msg.headers or {}
        undelivered = headers.get(PENDING_MESSAGES)
        if undelivered is not None:
            self._credits.ended(int(undelivered))
        else:
            log.info("pull_request_refused", consumer=self._name,
                     status=headers.get(Header.STATUS), reason=headers.get(Header.DESCRIPTION))
        self._wake.set()


class Delivery:
    """A delivered message while its handler works on it, and how it is settled.

    In-progress heartbeats (`+WPI`) keep the server from redelivering it: a
    long answer must not look like a dead consumer. They stop before any
    acknowledgement, hand-back or termination, since the server takes a
    `+WPI` that follows a delayed `-NAK` as a fresh lease: the message then
    comes back after a whole ack wait instead of the delay."""

    def __init__(self, msg: Msg, heartbeat_s: float) -> None:
        self.msg = msg
        self.settled = False
        self._every_s = heartbeat_s
        # A timer, not a sleeping task: most messages are settled long before
        # the first beat, and a task made and cancelled for each costs more.
        self._timer = asyncio.get_running_loop().call_later(heartbeat_s, self._beat)
        self._beating: asyncio.Task[None] | None = None

    def _beat(self) -> None:
        self._beating = asyncio.create_task(self._send_beat())
        self._timer = asyncio.get_running_loop().call_later(self._every_s, self._beat)

    async def _send_beat(self) -> None:
        with contextlib.suppress(Exception):
            await self.msg.in_progress()

    def stop_heartbeat(self) -> None:
        # A beat being written is already in the connection's buffer, ahead of
        # what the caller sends next; a cancelled one never gets that far.
        self._timer.cancel()
        if self._beating is not None:
            self._beating.cancel()

    async def ack(self) -> None:
        self._settling()
        await self.msg.ack()

    def ack_confirmed(self, timeout_s: float) -> asyncio.Task[bool]:
        """Acknowledge, asking the server to confirm that it took the
        acknowledgement (a double ack): the task says whether it did in time.
        Settled from this call on, though the acknowledgement is sent from
        the task."""
        self._settling()
        return asyncio.create_task(self._ack_sync(timeout_s))

    async def _ack_sync(self, timeout_s: float) -> bool:
        try:
            await self.msg.ack_sync(timeout=timeout_s)
        except Exception as err:  # refused, lost, or NATS away
            log.warning("acknowledgement_unconfirmed", error=f"{type(err).__name__}: {err}")
            return False
        return True

    async def nak(self, delay_s: float | None = None) -> None:
        self._settling()
        await self.msg.nak(delay=delay_s)

    async def term(self) -> None:
        self._settling()
        await self.msg.term()

    def _settling(self) -> None:
        self.stop_heartbeat()
        self.settled = True


# Heartbeats a delivery sends within its consumer's ack wait: a stall of two
# of them, not one, is needed before the server redelivers it.
BEATS_PER_ACK_WAIT = 3


@contextlib.asynccontextmanager
async def working_on(msg: Msg, ack_wait_s: float, **context: str
                     ) -> AsyncIterator[Delivery]:
    """A message being worked on: logged with its ids (`context`), kept from
    redelivery by heartbeats within its consumer's `ack_wait_s` (long answers,
    and waiting behind a session's earlier query, must not look like a dead
    consumer), and handed back at once if the work is cancelled (at shutdown)
    before it was settled."""
    delivery = Delivery(msg, ack_wait_s / BEATS_PER_ACK_WAIT)
    try:
        with structlog.contextvars.bound_contextvars(**context):
            try:
                yield delivery
            except asyncio.CancelledError:
                if not delivery.settled:
                    log.warning("handed_back_at_shutdown")
                    with contextlib.suppress(Exception):
                        await delivery.nak()
                raise
    finally:
        delivery.stop_heartbeat()
