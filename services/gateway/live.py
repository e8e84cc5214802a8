"""The page's live view: generator states, compaction events, generation
reports and sessions deleted, fanned out from NATS to every open
`/api/events` stream; and, to every stream whatever its session, a live
settings change (a put in the `config` bucket), so that a page shows where
automatic compaction now begins without waiting for its next read.

The gateway subscribes only while at least one page listens: otherwise every
turn's state transitions would cross into this process for nobody. When the
gateway stops, every stream ends at once (the page's EventSource reconnects
by itself) rather than holding the stop up until the runner's bound."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import UTC, datetime

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from schemas import subjects
from schemas.messages import (
    CompactionEvent,
    CompactionRequest,
    CompactionResult,
    GenerationReport,
    SessionDeleted,
    StateChange,
)
from services.gateway.settings import GatewaySettings
from services.shared.bus import parse_json, round_trip

# Each watched subject and the event name its messages go out under. The name
# is never read from a message: one with a line break in its `message_type`
# would have written events of its own into every page's stream.
WATCHED = {
    f"{subjects.STATE_PREFIX}.*": StateChange.MESSAGE_TYPE,
    subjects.RESPONSE_GENERATION: GenerationReport.MESSAGE_TYPE,
    subjects.COMPACTION_REQUEST: CompactionRequest.MESSAGE_TYPE,
    subjects.COMPACTION_RESULT: CompactionResult.MESSAGE_TYPE,
    subjects.COMPACTION_EVENT: CompactionEvent.MESSAGE_TYPE,
    f"{subjects.SESSION_DELETED_PREFIX}.*": SessionDeleted.MESSAGE_TYPE,
}
# The event a live settings change goes out under, to every stream.
SETTINGS_CHANGED = "settings.changed"
KEEPALIVE_S = 15.0
# A page that stops reading misses the newest events rather than growing our memory.
QUEUE_LIMIT = 1000
# (event name, subject, envelope), or the end of the stream.
Listener = asyncio.Queue[tuple[str, str, dict[str, object]] | None]
_END = None  # put in a listener's queue: its stream ends


class LiveFeed:
    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._listeners: set[Listener] = set()
        self._ended = False
        self._subs: list[Subscription] = []
        # Listeners come and go concurrently; subscribing is not atomic.
        self._subscribing = asyncio.Lock()
        self._cleanups: set[asyncio.Task[None]] = set()

    @property
    def subscribed(self) -> bool:
        return bool(self._subs)

    async def start(self) -> None:
        pass  # subscriptions follow the listeners

    def end_streams(self) -> None:
        """Every open stream ends now, and any opened from here on at once."""
        self._ended = True
        for queue in self._listeners:
            queue.put_nowait(_END)

    async def stop(self) -> None:
        self._listeners.clear()
        await self._unsubscribe()

    def settings_changed(self, settings: GatewaySettings) -> None:
        """What the pages show of the live settings: the compaction threshold."""
        event: dict[str, object] = {
            "message_type": SETTINGS_CHANGED, "timestamp": datetime.now(UTC).isoformat(),
            "payload": {"compaction_threshold": settings.compaction_threshold}}
        self._pass_on(SETTINGS_CHANGED, subjects.CONFIG_BUCKET, event)

    def _pass_on(self, name: str, subject: str, envelope: dict[str, object]) -> None:
        for queue in self._listeners:
            if queue.qsize() < QUEUE_LIMIT:
                queue.put_nowait((name, subject, envelope))

    async def _subscribe(self) -> None:
        async with self._subscribing:
            if not self._subs:
                self._subs = [await self._nc.subscribe(subject, cb=self._passing_on(name))
                              for subject, name in WATCHED.items()]
                await round_trip(self._nc)  # events from here on reach the listener

    async def _unsubscribe(self) -> None:
        async with self._subscribing:
            if self._listeners:
                return  # somebody arrived meanwhile
            subs, self._subs = self._subs, []
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _passing_on(self, name: str) -> Callable[[Msg], Awaitable[None]]:
        async def on_message(msg: Msg) -> None:
            try:
                envelope = parse_json(msg.data)
            except ValueError:
                return  # malformed events are reported by the services that consume them
            if isinstance(envelope, dict):
                self._pass_on(name, msg.subject, envelope)
        return on_message

    async def stream(self, session_id: str | None) -> AsyncGenerator[str, None]:
        queue: Listener = asyncio.Queue()
        if self._ended:
            queue.put_nowait(_END)
        self._listeners.add(queue)
        try:
            await self._subscribe()
            yield ": connected\n\n"
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if event is _END:
                    return
                name, subject, envelope = event
                if session_id and name != SETTINGS_CHANGED \
                        and envelope.get("session_id") != session_id:
                    continue
                data = json.dumps({**envelope, "subject": subject})  # where it truly came
                yield f"event: {name}\ndata: {data}\n\n"
        finally:
            self._listeners.discard(queue)
            if not self._listeners:
                # A task of its own: this generator may be closing under a
                # cancellation that would cut the unsubscribing short.
                task = asyncio.create_task(self._unsubscribe())
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)


class ListenerLimit:
    """Open event streams per client address: each costs a queue of up to
    QUEUE_LIMIT events, so one client must not open them without end."""

    def __init__(self, per_client: int) -> None:
        self._per_client = per_client
        self._open: Counter[str] = Counter()

    def admit(self, client: str) -> Callable[[], None] | None:
        """A stream counted against the client until the returned release is
        called (once or more); None when the client already holds its share."""
        if self._open[client] >= self._per_client:
            return None
        self._open[client] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._open[client] -= 1
                if not self._open[client]:
                    del self._open[client]

        return release


class EventStream(StreamingResponse):
    """Server-sent events that give their client's share back and close their
    stream however the response ends. Starlette cancels the body of a client
    gone before its first byte before that body starts, and an async
    generator that never started never runs its `finally`.

    The headers wait for the stream's first piece: a page takes them for "the
    feed is open" (EventSource's `open`), and before that piece the stream
    may not yet be listening, so an event sent meanwhile was lost to it."""

    def __init__(self, stream: AsyncGenerator[str, None], release: Callable[[], None]) -> None:
        super().__init__(stream, media_type="text/event-stream")
        self._stream = stream
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(self._stream, None)
            self.body_iterator = _after(first, self._stream)
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            await self._stream.aclose()


async def _after(first: str | None, rest: AsyncGenerator[str, None]
                 ) -> AsyncGenerator[str, None]:
    if first is None:
        return
    yield first
    async for piece in rest:
        yield piece
