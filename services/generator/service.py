"""The generator process: pulls queries and compaction requests from their
work queues and answers many sessions at once, each in its own slot
(`slots.Slots`), a session's queries strictly in order (`queries`). It
also hears every stop, and keeps its consumers through NATS restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from schemas import subjects
from schemas.messages import (
    CompactionRequest,
    StopAccepted,
    StopRequest,
)
from services.core.state_machine import CompactionMode
from services.generator.compaction import Compactor
from services.generator.metered import MeteredProvider
from services.generator.provider import ChatProvider, OllamaProvider
from services.generator.queries import Queries
from services.generator.session_lock import SessionLocks
from services.generator.settings import GeneratorSettings
from services.generator.slots import Slots
from services.generator.states import SessionStates
from services.generator.toolbox import Toolbox
from services.generator.turns import TurnRunner
from services.shared.bus import Bus
from services.shared.consumer import PullLoop, ensure_consumer, working_on
from services.shared.history_store import HistoryStore
from services.shared.jetstream import locks_bucket
from services.shared.live_config import LiveSettings
from services.shared.runner import Endpoint
from services.shared.sessions import SessionStore

QUERY_CONSUMER = "generator"
COMPACTION_CONSUMER = "generator-compactions"
# At shutdown, how long turns in hand may run on before they are cancelled
# and their queries handed back; within the runner's budget for stopping.
SHUTDOWN_GRACE_S = 5.0
HAND_BACK_S = 2.0
log = structlog.get_logger()


class Generator:
    def __init__(self, bus: Bus, settings: GeneratorSettings, provider: ChatProvider,
                 sessions: SessionStore, locks: SessionLocks) -> None:
        self._bus = bus
        self._settings = settings
        self._provider = provider
        self._live = LiveSettings(bus.js, settings)
        self._history = HistoryStore(bus.js, on_foreign_write=locks.forget_release,
                                     nats_patience_s=settings.nats_away_patience_s)
        self._sessions = sessions
        self._states = SessionStates(bus, settings.generator_id,
                                     CompactionMode(settings.compaction_mode))
        toolbox = Toolbox(bus, settings.tool_timeout_s)
        self._compactor = Compactor(bus, self._live, MeteredProvider(provider, "summary"),
                                    self._history, sessions, locks, self._states, toolbox)
        self._turns = TurnRunner(bus, self._live, MeteredProvider(provider, "answer"),
                                 self._history, sessions,
                                 self._states, toolbox, self._compactor)
        self._tasks: set[asyncio.Task[None]] = set()
        # Queries and compactions being worked on, a session's queries sharing
        # one slot. A query gives its room back once its reply is out: what
        # follows (the lock's release, the report) is bookkeeping, and with
        # every slot taken the session's next query would otherwise find no
        # pull request standing for it.
        self._slots = Slots(settings.max_concurrent_sessions)
        # The compaction request being handled here, if any.
        self._compaction: asyncio.Task[None] | None = None
        self._loops: list[PullLoop] = []
        # Each loop's stream and consumer, made again when NATS comes back without them.
        self._consumers: list[tuple[str, ConsumerConfig]] = []
        self._queries = Queries(bus, settings, locks, sessions, self._states, self._turns,
                                self._compactor, self)
        self._following: JetStreamContext.PushSubscription | None = None
        self._stop_requests: Subscription | None = None

    async def start(self) -> None:
        await self._live.start()
        self._following = await self._history.follow()
        # Every generator hears every stop; only the one running the
        # session's answer acts and replies.
        self._stop_requests = await self._bus.nc.subscribe(f"{subjects.STOP_PREFIX}.*",
                                                           cb=self._on_stop)
        self._queries.hearing_stops()
        self._loops = [
            await self._pull(f"{subjects.QUERY_PREFIX}.*", subjects.QUERIES_STREAM,
                             QUERY_CONSUMER, self._spawn_query, self._capacity),
            await self._pull(subjects.COMPACTION_REQUEST, subjects.COMPACTIONS_STREAM,
                             COMPACTION_CONSUMER, self._spawn_compaction,
                             self._compaction_capacity),
        ]
        for loop in self._loops:
            await loop.start()

    async def _pull(self, subject: str, stream: str, durable: str,
                    on_message: Callable[[Msg], Awaitable[None]],
                    capacity: Callable[[], int]) -> PullLoop:
        """A loop on a durable consumer shared by every generator process."""
        config = work_queue_consumer(durable, subject, self._settings.query_ack_wait_s)
        await ensure_consumer(self._bus.nc, stream, config)
        self._consumers.append((stream, config))
        return PullLoop(self._bus.nc, stream, durable, on_message, capacity)

    async def reconnected(self) -> None:
        """NATS came back, perhaps without its store: make again what lived
        in it (the consumers, the history follower, the settings watch, the
        record of the compactions running here) and read sessions afresh
        rather than trust what was cached of them."""
        self._queries.hearing_stops()
        self._sessions.forget_all()
        await self._states.record_running_again()
        self._following = await self._history.follow_again(self._following)
        await self._live.watch_again()
        for (stream, config), loop in zip(self._consumers, self._loops, strict=True):
            if await ensure_consumer(self._bus.nc, stream, config):
                loop.renew()

    async def stop(self) -> None:
        await self._live.stop()
        for subscription in (self._following, self._stop_requests):
            if subscription is not None:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        for loop in self._loops:
            await loop.stop()
        await self._finish_or_hand_back()
        self._queries.answered.cancel_pending()
        await self._states.stop()
        await self._provider.close()

    async def _finish_or_hand_back(self) -> None:
        """Let the turns in hand finish for a while, then cancel them: each
        cancelled one hands its query back at once (`working_on`), and
        another generator answers it now rather than after a whole ack wait."""
        if not self._tasks:
            return
        _, unfinished = await asyncio.wait(self._tasks, timeout=SHUTDOWN_GRACE_S)
        if not unfinished:
            return
        log.warning("work_cancelled_at_shutdown", tasks=len(unfinished))
        for task in unfinished:
            task.cancel()
        await asyncio.wait(unfinished, timeout=HAND_BACK_S)

    async def _on_stop(self, msg: Msg) -> None:
        env = await self._bus.decode_or_refuse(msg, StopRequest)
        if env is None:
            return
        sid, query_id = env.payload.session_id, env.payload.query_id
        outcome = self._turns.stops.stop(sid, query_id)
        if outcome is None or not msg.reply:
            return  # neither running nor held here: the process that holds it answers
        query_id = query_id or self._turns.stops.running_query(sid)
        log.info("stop_requested", session_id=sid, query_id=query_id, outcome=outcome.value,
                 correlation_id=env.correlation_id)
        with contextlib.suppress(Exception):
            await self._bus.respond(msg, StopAccepted(
                session_id=sid, query_id=query_id or "",
                generator_id=self._settings.generator_id, status=outcome.value),
                correlation_id=env.correlation_id, session_id=sid)

    def endpoints(self) -> list[Endpoint]:
        return []

    def status(self) -> dict[str, Any]:
        return {
            "generator_id": self._settings.generator_id,
            "active_sessions": self._states.busy_sessions(),
            "free_slots": max(0, self._capacity()),
            "answered": self._queries.answered.count,
            "head_starts": {"kept": self._turns.head_starts.kept,
                            "abandoned": self._turns.head_starts.abandoned},
            "model": self._settings.model,
            "num_ctx": self._settings.num_ctx,
        }

    def _capacity(self) -> int:
        return self._slots.free()

    def _compaction_capacity(self) -> int:
        """Compactions and queries share `max_concurrent_sessions`, and each
        loop keeps requests standing for the room it may fill. Splitting the
        room exactly would leave one of them a standing share it may never
        use (with one slot, nothing at all for the other); so queries see all
        of it, and compactions, rare, run one at a time: at most one
        compaction beyond the setting. (Were each to ask for the next, a burst
        of them could fill every slot while the queries' requests still stood.)"""
        if self._compaction is not None and not self._compaction.done():
            return 0
        return min(1, self._capacity())

    async def _spawn_query(self, msg: Msg) -> None:
        self._spawn(self._queries.handle(msg))

    async def _spawn_compaction(self, msg: Msg) -> None:
        self._compaction = self._spawn(self._handle_compaction(msg))

    async def _handle_compaction(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, CompactionRequest)
        if env is None:
            await msg.term()  # a malformed request would only come back
            return
        async with working_on(msg, self._settings.query_ack_wait_s,
                              session_id=env.payload.session_id,
                              correlation_id=env.correlation_id) as delivery:
            await self._compactor.handle(env)
            await delivery.ack()

    def _spawn(self, work: Coroutine[Any, Any, None], busy: bool = True
               ) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if busy:
            self._slots.take(task)
            task.add_done_callback(self.give_back)
        return task

    def _room_freed(self) -> None:
        for loop in self._loops:
            loop.room_freed()

    # The query path's `Room`.

    def join_session(self, task: asyncio.Task[Any] | None, sid: str) -> None:
        if self._slots.holds(task) and self._slots.join(task, sid):
            self._room_freed()  # queued behind the session's own query: no slot of its own

    def give_back(self, task: asyncio.Task[Any] | None) -> None:
        if self._slots.give_back(task):
            self._room_freed()

    def spawn_unslotted(self, work: Coroutine[Any, Any, None]) -> None:
        self._spawn(work, busy=False)


def work_queue_consumer(durable: str, subject: str, ack_wait_s: float) -> ConsumerConfig:
    """The durable consumer every generator process shares on a work queue."""
    return ConsumerConfig(durable_name=durable, filter_subject=subject,
                          ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
                          max_ack_pending=10_000)


async def build(bus: Bus, settings: GeneratorSettings) -> Generator:
    sessions = await SessionStore.open(bus.js)
    locks = SessionLocks(await locks_bucket(bus.js, settings.lock_lease_s),
                         settings.generator_id, settings.lock_lease_s, settings.lock_wait_s)
    limits = settings.model_time_limits()
    provider = OllamaProvider(settings.ollama_host, limits.first_token_s,
                              connections=settings.max_concurrent_sessions, gap_s=limits.gap_s)
    return Generator(bus, settings, provider, sessions, locks)
