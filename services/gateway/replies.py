"""Routes replies and streamed tokens from the generator to the HTTP request
waiting for them.

One wildcard subscription per gateway process; each waiting request has a
queue. Tokens and replies find it by their query id, so they also reach a
resend under the same `Idempotency-Key` (which the QUERIES stream kept once),
waiting under a correlation id of its own: a page reloaded mid-answer sees
the rest of it written. A reply that arrives
for nobody (the caller gave up) is dropped. What became of a query sent before
is read from the history (an answer) or from the kept error replies
(`services.shared.query_errors`): a resend under the same key within the
stream's duplicate window is kept once, and would otherwise wait for a reply
already sent.

Replies are core NATS messages: one sent while this process's connection was
away (a NATS node lost, a restart) never arrives. The turn is stored, or the
error kept, before its reply is sent, so when NATS is back each request still
waiting looks for its answer in the session's history, then for its error. A
query found in none of them, nor still in the queue, was lost with NATS's
store: its caller is told so at once, not after REPLY_TIMEOUT_S that it stays
queued.

When the gateway stops, the requests still waiting get a short grace for
their replies; then each is told the gateway is stopping (GatewayStopping),
so its caller gets a clear answer instead of a connection cut at the
runner's bound. Their queries stay queued and are answered into the history.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import subjects
from schemas.envelope import new_id
from schemas.messages import ErrorCode, Reply, Token
from services.shared.bus import MSG_ID_HEADER, Bus
from services.shared.history_store import HistoryStore
from services.shared.jetstream import QueuedQueries
from services.shared.query_errors import KeptError, QueryErrors

log = structlog.get_logger()
LOST = ("NATS came back without this query (its store was lost?): it was not answered, and "
        "nothing of it was stored; send it again")
Event = Reply | Token
# Put in a waiting request's queue when the gateway stops before its reply.
_STOPPING = None


async def still_queued(bus: Bus, sid: str, query_id: str) -> bool:
    """Whether the query is in the QUERIES stream: waiting, or being answered."""
    async for msg in QueuedQueries(bus.js, sid, bus.fresh_reads_direct):
        if (msg.headers or {}).get(MSG_ID_HEADER) == query_id:
            return True
    return False


class GatewayStopping(Exception):
    """The gateway stops before the reply came; the query stays queued."""


@dataclass(eq=False)  # each request its own, equal to no other
class Waiting:
    """A request waiting for its reply: the query it sends, under what ids,
    and the queue its tokens and reply arrive in."""

    sid: str
    query_id: str = field(default_factory=new_id)
    correlation_id: str = field(default_factory=new_id)
    events: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)
    # The QUERIES stream confirmed it holds the query: from then on, its
    # absence there means it was answered, or lost.
    stored: bool = False


class ReplyRouter:
    def __init__(self, bus: Bus, history: HistoryStore, errors: QueryErrors) -> None:
        self._bus = bus
        self._history = history
        self._errors = errors
        self._waiting: dict[str, Waiting] = {}  # by correlation id
        self._by_query: dict[str, set[Waiting]] = {}
        self._none_waiting = asyncio.Event()
        self._none_waiting.set()
        self._stopping = asyncio.Event()
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        self._subs = [
            await self._bus.nc.subscribe(f"{subjects.REPLY_PREFIX}.*", cb=self._on_reply),
            await self._bus.nc.subscribe(f"{subjects.TOKEN_PREFIX}.*", cb=self._on_token),
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def stop_waiting(self, grace_s: float) -> None:
        """The gateway stops: the requests waiting get up to `grace_s` for
        their replies, then each (and any that arrives later) is told."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._none_waiting.wait()
        self._stopping.set()
        for waiting in self._waiting.values():
            waiting.events.put_nowait(_STOPPING)

    @contextlib.contextmanager
    def expect(self, sid: str, query_id: str | None = None) -> Iterator[Waiting]:
        """Register before publishing, so no reply can arrive unseen."""
        waiting = Waiting(sid, query_id or new_id())
        if self._stopping.is_set():
            waiting.events.put_nowait(_STOPPING)
        self._waiting[waiting.correlation_id] = waiting
        self._by_query.setdefault(waiting.query_id, set()).add(waiting)
        self._none_waiting.clear()
        try:
            yield waiting
        finally:
            self._waiting.pop(waiting.correlation_id, None)
            self._forget(waiting)
            if not self._waiting:
                self._none_waiting.set()

    def _forget(self, waiting: Waiting) -> None:
        same_query = self._by_query.get(waiting.query_id, set())
        same_query.discard(waiting)
        if not same_query:
            self._by_query.pop(waiting.query_id, None)

    async def error_of(self, query_id: str) -> KeptError | None:
        """The error reply this query got, if one came within the QUERIES
        stream's duplicate window (past it, a resend is a new try)."""
        return await self._errors.of(query_id)

    async def stopping_within(self, seconds: float) -> bool:
        """Whether the gateway tells its waiting callers it stops within `seconds`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    async def recover_missed(self) -> None:
        """NATS is back: each request still waiting whose answer was stored, or
        error kept, meanwhile gets it (its reply may have been lost); one whose
        stored query is gone unanswered is told it was lost. Raises, for the
        reconnect to try again, if some could not be looked at."""
        unchecked = 0
        for waiting in list(self._waiting.values()):
            try:
                reply = await self._outcome(waiting)
            except Exception as err:  # NATS away again: tried again
                log.warning("missed_reply_unchecked", session_id=waiting.sid, error=repr(err))
                unchecked += 1
                continue
            if reply is not None:
                log.info("missed_reply_recovered", session_id=waiting.sid,
                         query_id=waiting.query_id, error_code=reply.error_code)
                waiting.events.put_nowait(reply)
        if unchecked:
            raise RuntimeError(f"{unchecked} waiting requests not looked at")

    async def _outcome(self, waiting: Waiting) -> Reply | None:
        """The reply the waiter missed; None while its query is still to be
        answered. The queue is read first: a query answered after that look
        is in the history when it is read."""
        sid, query_id = waiting.sid, waiting.query_id
        queued = waiting.stored and await still_queued(self._bus, sid, query_id)
        reply = ((await self._history.read(sid)).conversation.answered(sid, query_id)
                 or await self._errors.reply_of(query_id))
        if reply is None and waiting.stored and not queued:
            return Reply(session_id=sid, query_id=query_id, error_code=ErrorCode.nats_unavailable,
                         error=LOST)
        return reply

    async def _on_reply(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, Reply)
        if env is None:
            return
        self._pass_on(env.payload)

    async def _on_token(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, Token)
        if env is not None:
            self._pass_on(env.payload)

    def _pass_on(self, event: Event) -> None:
        for waiting in self._by_query.get(event.query_id, ()):
            if waiting.sid == event.session_id:  # another session's is not ours
                waiting.events.put_nowait(event)


async def events_until_reply(queue: asyncio.Queue[Event | None], timeout_s: float
                             ) -> AsyncIterator[Event]:
    """Tokens as they come, then the reply; TimeoutError if the reply is
    late, GatewayStopping if the gateway stops first.

    The deadline covers only the waits here, never the `yield`: a deadline
    passing while the caller is away sending the last token would cancel the
    caller's own work instead of raising here."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        event = await _next_event(queue, deadline)
        yield event
        if isinstance(event, Reply):
            return


async def reply_within(queue: asyncio.Queue[Event | None], timeout_s: float) -> Reply:
    """The reply, the tokens before it passed over (an answer not streamed).
    The events are read to their end, which the reply is: nothing is left
    open for the event loop to close later."""
    reply: Reply | None = None
    async for event in events_until_reply(queue, timeout_s):
        if isinstance(event, Reply):
            reply = event
    assert reply is not None  # the events end only with it, or raise
    return reply


async def streamed_events(queue: asyncio.Queue[Event | None], quiet_limit_s: float,
                          keep_alive_s: float) -> AsyncIterator[Event | None]:
    """As `events_until_reply`, for an answer streamed as it is written: late
    means `quiet_limit_s` without a token, not in all (a slow model writes
    for longer than that, and every token shows it at work); and None after
    each `keep_alive_s` of quiet (in the queue, behind the lock, while the
    model loads), for the caller to keep its stream open through proxies
    that cut idle ones."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + quiet_limit_s
    while True:
        beat = loop.time() + keep_alive_s
        try:
            event = await _next_event(queue, min(deadline, beat))
        except TimeoutError:
            if beat >= deadline:
                raise
            yield None
            continue
        yield event
        if isinstance(event, Reply):
            return
        deadline = loop.time() + quiet_limit_s


async def _next_event(queue: asyncio.Queue[Event | None], deadline: float) -> Event:
    async with asyncio.timeout_at(deadline):
        event = await queue.get()
    if event is _STOPPING:
        raise GatewayStopping
    return event
