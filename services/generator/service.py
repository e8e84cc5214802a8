"""The generator process: pulls queries from the QUERIES work queue, answers
many sessions at once and each session's queries strictly in order.

Ordering holds across processes without any coordinator: a work-queue stream
deletes a query when it is acknowledged, so the oldest query still in the
stream for a session is the next one to answer. A process holding a later
query of that session hands it back with a short delay (growing while the
same earlier query stays pending), and whoever holds the earlier one answers
it first; the session lock then keeps the two from ever overlapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import (
    CompactionRequest,
    ErrorCode,
    ErrorReport,
    Query,
    Reply,
    StopAccepted,
    StopRequest,
)
from services.core.failed_tries import Failure, TryAgain
from services.core.state_machine import Action, CompactionMode
from services.generator.answered import AnsweredQueries, FailedTries, failure_of
from services.generator.arrival_order import ArrivalOrder, HandBacks
from services.generator.compaction import Compactor
from services.generator.head_start import HeadStart
from services.generator.metered import MeteredProvider
from services.generator.provider import ChatProvider, OllamaProvider
from services.generator.session_lock import Lease, LockTimeout, SessionLocks
from services.generator.settings import GeneratorSettings
from services.generator.slots import Slots
from services.generator.states import SessionStates
from services.generator.toolbox import Toolbox
from services.generator.turn import TurnError
from services.generator.turns import FollowUp, TurnRunner
from services.shared import metrics
from services.shared.bus import MSG_ID_HEADER, BadMessage, Bus, decode, readable_id
from services.shared.consumer import Delivery, PullLoop, ensure_consumer
from services.shared.history_store import HistoryConflict, HistoryStore
from services.shared.jetstream import NO_ROOM, locks_bucket, queued_queries
from services.shared.live_config import LiveSettings
from services.shared.nats_away import NATS_AWAY
from services.shared.query_errors import QueryErrors
from services.shared.runner import Endpoint
from services.shared.sessions import SessionNotFound, SessionStore
from services.shared.together import together

QUERY_CONSUMER = "generator"
COMPACTION_CONSUMER = "generator-compactions"
# What a caller is told when its query is given up on, by error code.
FAILURE_TEXT = {
    "internal_error": "the generator failed on this query: {}",
    "nats_unavailable": "NATS did not answer the generator for too long ({}); "
                        "try again in a moment",
    "storage_full": f"nothing was stored: {NO_ROOM}",
}
# How long a later query of a session waits before it is offered again, at
# first and at most (see `HandBacks`).
OUT_OF_ORDER_DELAY_S = 0.02
OUT_OF_ORDER_MAX_DELAY_S = 0.5
# How long the server may take to confirm that it took an acknowledgement.
ACK_CONFIRM_S = 5.0
# At shutdown, how long turns in hand may run on before they are cancelled
# and their queries handed back; within the runner's budget for stopping.
SHUTDOWN_GRACE_S = 5.0
HAND_BACK_S = 2.0
# The server stamps a query's time, this process its own start of listening:
# a query stored up to this long after it is still read as maybe unheard.
STOP_CLOCK_MARGIN = timedelta(seconds=5)
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
        self._locks = locks
        self._states = SessionStates(bus, settings.generator_id,
                                     CompactionMode(settings.compaction_mode))
        toolbox = Toolbox(bus, settings.tool_timeout_s)
        self._compactor = Compactor(bus, self._live, MeteredProvider(provider, "summary"),
                                    self._history, sessions, locks, self._states, toolbox)
        self._turns = TurnRunner(bus, self._live, MeteredProvider(provider, "answer"),
                                 self._history, sessions,
                                 self._states, toolbox, self._compactor)
        self._arrival = ArrivalOrder()
        self._hand_backs = HandBacks(OUT_OF_ORDER_DELAY_S, OUT_OF_ORDER_MAX_DELAY_S)
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
        self._answered = AnsweredQueries()
        self._errors = QueryErrors(bus.js)
        self._failures = FailedTries(settings.nats_away_patience_s)
        self._following: JetStreamContext.PushSubscription | None = None
        self._stop_requests: Subscription | None = None
        # Since when this process has heard every stop (it began to listen,
        # or NATS came back): see `_may_have_missed_a_stop`.
        self._hearing_stops_since = datetime.now(UTC)

    async def start(self) -> None:
        await self._live.start()
        self._following = await self._history.follow()
        # Every generator hears every stop; only the one running the
        # session's answer acts and replies.
        self._stop_requests = await self._bus.nc.subscribe(f"{subjects.STOP_PREFIX}.*",
                                                           cb=self._on_stop)
        self._hearing_stops_since = datetime.now(UTC)
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
        self._hearing_stops_since = datetime.now(UTC)
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
        self._answered.cancel_pending()
        await self._states.stop()
        await self._provider.close()

    async def _finish_or_hand_back(self) -> None:
        """Let the turns in hand finish for a while, then cancel them: each
        cancelled one hands its query back at once (`_working_on`), and
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
            "answered": self._answered.count,
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
        self._spawn(self._handle(msg))

    async def _spawn_compaction(self, msg: Msg) -> None:
        self._compaction = self._spawn(self._handle_compaction(msg))

    async def _handle_compaction(self, msg: Msg) -> None:
        env = await self._bus.decode_or_report(msg, CompactionRequest)
        if env is None:
            await msg.term()  # a malformed request would only come back
            return
        async with self._working_on(msg, env.payload.session_id,
                                    env.correlation_id) as delivery:
            await self._compactor.handle(env)
            await delivery.ack()

    @contextlib.asynccontextmanager
    async def _working_on(self, msg: Msg, sid: str, correlation_id: str,
                          **context: str) -> AsyncIterator[Delivery]:
        """Log with the message's ids, and keep it from being redelivered while
        we work: long answers (and waiting behind a session's earlier query)
        must not look like a dead generator. Work cancelled (at shutdown)
        before its message was settled hands the message back at once."""
        delivery = Delivery(msg, self._settings.query_ack_wait_s / 3)
        try:
            with structlog.contextvars.bound_contextvars(
                session_id=sid, correlation_id=correlation_id, **context
            ):
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

    def _spawn(self, work: Coroutine[Any, Any, None], busy: bool = True
               ) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if busy:
            self._slots.take(task)
            task.add_done_callback(self._give_room_back)
        return task

    def _give_room_back(self, task: asyncio.Task[Any] | None) -> None:
        if self._slots.give_back(task):
            self._room_freed()

    def _room_freed(self) -> None:
        for loop in self._loops:
            loop.room_freed()

    async def _handle(self, msg: Msg) -> None:
        try:
            env = decode(msg.data, Query, msg.subject)
        except BadMessage as err:
            await self._bus.report_bad_event(err)
            await self._refuse_malformed(msg, err.report)
            return
        sid = env.payload.session_id
        metrics.generator().query_received(env.timestamp, msg.metadata.num_delivered)
        task = asyncio.current_task()
        if self._slots.holds(task) and self._slots.join(task, sid):
            self._room_freed()  # queued behind the session's own query: no slot of its own
        # Held from here to its reply: a stop meanwhile withdraws it, or is too late.
        with self._turns.stops.holding(env.message_id):
            await self._settle(msg, env, sid)

    async def _settle(self, msg: Msg, env: Envelope[Query], sid: str) -> None:
        async with self._working_on(msg, sid, env.correlation_id,
                                    query_id=env.message_id) as delivery:
            async with self._arrival.turn(sid):
                try:
                    follow_up = await self._answer_in_order(delivery, env)
                except Exception as err:  # e.g. NATS away while taking the lock
                    await self._unexpected(delivery, env, err)
                    follow_up = None
            if follow_up is not None:  # outside the session's locks, and its slot
                self._spawn(follow_up(), busy=False)

    async def _refuse_malformed(self, msg: Msg, report: ErrorReport) -> None:
        """Dropped (it would only come back), and its caller told why when the
        subject names a session and the message an id to answer it under:
        a caller waiting on `chat.reply.<sid>` would wait out its timeout."""
        await msg.term()
        sid, query_id = subjects.session_in(msg.subject), readable_id(msg.data)
        if sid is None or query_id is None or not subjects.is_valid_session_id(sid):
            return
        with contextlib.suppress(*NATS_AWAY):
            await self._bus.publish(subjects.reply(sid), Reply(
                session_id=sid, query_id=query_id, error_code=ErrorCode.invalid_message,
                error=report.message), session_id=sid)

    async def _answer_in_order(self, delivery: Delivery, env: Envelope[Query]
                               ) -> FollowUp | None:
        sid, msg = env.payload.session_id, delivery.msg
        answered = await self._error_answered(msg, env.message_id)
        if answered is not None:  # its acknowledgement was lost: the same answer again
            log.warning("query_answered_again", error_code=answered.error_code)
            await self._send_reply(delivery, env, answered)
            return None
        blocked = await self._meets_compaction(sid)
        wait = self._settings.blocking_query_wait_s if blocked else None
        # The model call starts now, unless this is a redelivery (the answer
        # may be stored already) or the session is to wait for a compaction.
        early = (not blocked and msg.metadata.num_delivered == 1
                 and not self._turns.stops.withdrawn(env.message_id))
        head = await self._turns.head_start(env) if early else None
        asked = metrics.Timer()
        try:
            earlier, taken = await self._first_try(sid, msg)
            if earlier is not None:
                await delivery.nak(self._hand_backs.delay(env.message_id, earlier))
                return None
            self._hand_backs.forget(env.message_id)
            if taken is None and head is not None:
                head.abandon()  # someone else holds the session: its history will move
                head = None
            async with self._locks.hold(sid, "query", wait_s=wait, taken=taken) as lease:
                metrics.generator().lock_wait.observe(asked.elapsed())
                return await self._answer(delivery, env, lease, head)
        except LockTimeout:
            await self._lock_timed_out(delivery, env, blocked)
            return None
        finally:
            if head is not None:
                head.abandon()  # nothing once the turn has used it

    async def _error_answered(self, msg: Msg, query_id: str) -> Reply | None:
        """The error this query was answered with, by this process or, for a
        redelivery, any other (one that died before its acknowledgement
        reached the server): such a query must not be answered anew. Not
        `nats_unavailable`: the turn may have been stored all the same, and
        the history, read under the lock, says whether it was."""
        reply = self._answered.error_reply(msg.metadata.sequence.stream, query_id)
        if reply is None and (msg.metadata.num_delivered > 1
                              or self._may_have_missed_a_stop(msg)):
            reply = await self._errors.reply_of(query_id)
        if reply is not None and reply.error_code == "nats_unavailable":
            return None
        return reply

    def _may_have_missed_a_stop(self, msg: Msg) -> bool:
        """A query queued before this process heard every stop may have been
        withdrawn meanwhile: the gateway keeps that as the query's error reply,
        read then. Later ones need no read: their stops were heard."""
        return msg.metadata.timestamp < self._hearing_stops_since + STOP_CLOCK_MARGIN

    async def _meets_compaction(self, sid: str) -> bool:
        """Blocking mode: a query meeting a compaction waits only so long, then
        gets an error instead of the answer."""
        return self._compactor.blocking and (
            self._compactor.running(sid) or await self._locks.purpose_of(sid) == "compaction")

    async def _lock_timed_out(self, delivery: Delivery, env: Envelope[Query],
                              blocked: bool) -> None:
        """A query that met a compaction in blocking mode is told so; any
        other goes back to the stream, to try again in a second."""
        if blocked:
            await self._send_reply(delivery, env, self._error_reply(env, TurnError(
                ErrorCode.compacting, "the session is being compacted (blocking mode); "
                "try again when it is done")))
            return
        log.warning("session_lock_timeout")
        await delivery.nak(1.0)

    async def _first_try(self, sid: str, msg: Msg) -> tuple[int | None, Lease | None]:
        """The stream sequence of an earlier query of the session still
        pending, if any, and the session's lock if it is free right now.

        On a first delivery both are asked together, since each is a round
        trip and the query is usually next. (No query can join the stream
        ahead of this one, so the ordering check need not wait for the lock.)
        A query that comes back was most likely handed back to wait for an
        earlier one: the order is checked first, and the lock taken only when
        it is this query's turn, not taken and freed again (two writes) on
        every hand-back while the earlier one waits for its redelivery."""
        if msg.metadata.num_delivered > 1:
            earlier = await self._earlier_query_pending(sid, msg)
            if earlier is not None:
                return earlier, None
            return None, await self._locks.try_acquire(sid, "query")
        # The lock first: a write, usually the later of the two to answer.
        taken, pending = await together(self._locks.try_acquire(sid, "query"),
                                        self._earlier_query_pending(sid, msg))
        if isinstance(taken, Exception):
            raise taken
        if pending is not None:  # an earlier query waits, or the check failed
            if taken is not None:
                await self._locks.release(taken, used=False)  # not ours to use yet
            if isinstance(pending, Exception):
                raise pending
            return pending, None
        return None, taken

    async def _answer(self, delivery: Delivery, env: Envelope[Query], lease: Lease,
                      head: HeadStart | None) -> FollowUp | None:
        sid = env.payload.session_id
        if delivery.msg.metadata.num_delivered > 1:
            await self._compactor.end_left_running(sid, env.correlation_id)
        await self._states.apply(sid, Action.receive, env.correlation_id)
        follow_up = None
        try:
            record = await self._sessions.get(sid)
            reply, follow_up = await self._turns.run(env, record, lease, head)
        except HistoryConflict:
            # Our view is stale (we lost the lease while frozen, or a write tried
            # again after its answer was lost went through the first time): let
            # the query come back; the redelivery sees what was written and never
            # answers twice. Handled, so a warning: nothing is lost.
            log.warning("stale_history_write_rejected")
            metrics.generator().stale_writes.inc()
            await self._states.recover(sid, env.correlation_id)
            await delivery.nak(0.2)
            return None
        except (SessionNotFound, TurnError) as err:
            await self._states.recover(sid, env.correlation_id)
            reply = self._error_reply(env, err)
        except Exception as err:
            await self._unexpected(delivery, env, err)
            return None
        else:
            await self._states.apply(sid, Action.reset, env.correlation_id)
        await self._send_reply(delivery, env, reply)
        return follow_up

    async def _send_reply(self, delivery: Delivery, env: Envelope[Query], reply: Reply) -> None:
        # The acknowledgement goes out with the reply, its confirmation not
        # waited for: the caller need not wait for it, only the ordering check
        # of the session's next query does. Which reaches the server first is
        # not certain, so a crash now may cost the acknowledgement: the turn is
        # stored by now and a redelivery finds it; an error is kept first, so
        # a redelivery (and whoever finds the query gone) finds that too.
        if reply.error:
            await self._errors.keep(reply, env.payload.content)
        self._answered.remember(delivery.msg.metadata.sequence.stream, reply,
                                delivery.ack_confirmed(ACK_CONFIRM_S))
        sid = env.payload.session_id
        metrics.generator().turn_finished(env.timestamp, reply.error_code)
        await self._bus.publish(subjects.reply(sid), reply,
                                correlation_id=env.correlation_id, session_id=sid)
        self._give_room_back(asyncio.current_task())

    async def _unexpected(self, delivery: Delivery, env: Envelope[Query],
                          err: Exception) -> None:
        """A bug, NATS not answering, or NATS without room (for the session's
        lock: nothing of the turn is stored yet): try again in a while, or
        tell the caller (`services.core.failed_tries`)."""
        failure = failure_of(err)
        if failure is Failure.crash:
            log.exception("query_crashed", error=str(err))
        else:
            log.warning(f"query_met_{failure.value}", error=type(err).__name__,
                        where=raised_in(err))
        sid = env.payload.session_id
        with contextlib.suppress(Exception):
            await self._states.recover(sid, env.correlation_id)
        outcome = self._failures.count(env.message_id, err)
        if isinstance(outcome, TryAgain):
            await delivery.nak(outcome.after_s)
            return
        await self._send_reply(delivery, env, self._error_reply(env, TurnError(
            outcome.code, FAILURE_TEXT[outcome.code].format(type(err).__name__))))

    def _error_reply(self, env: Envelope[Query], err: Exception) -> Reply:
        sid = env.payload.session_id
        if isinstance(err, SessionNotFound):
            code, text = ErrorCode.unknown_session, f"session {sid} does not exist"
        else:
            assert isinstance(err, TurnError)
            code, text = err.code, str(err)
        log.warning("query_failed", error_code=code, error=text)
        return Reply(session_id=sid, query_id=env.message_id, error=text, error_code=code)

    async def _earlier_query_pending(self, sid: str, msg: Msg) -> int | None:
        """The stream sequence of the session's oldest query before this one
        that is still to be answered, if any (one acknowledged here may not yet
        be dropped by the server)."""
        ours = msg.metadata.sequence.stream
        async for oldest in queued_queries(self._bus.js, sid, self._bus.fresh_reads_direct):
            seq = int(oldest.seq or 0)
            if seq >= ours:
                return None
            if not await self._answered.acknowledged(
                    seq, (oldest.headers or {}).get(MSG_ID_HEADER)):
                return seq
        return None

def raised_in(err: BaseException) -> str:
    """The last of our functions the error passed through: which of a turn's
    NATS calls did not answer, where the error's type alone cannot say."""
    ours = [frame for frame in traceback.extract_tb(err.__traceback__)
            if f"{os.sep}services{os.sep}" in frame.filename]
    return f"{Path(ours[-1].filename).stem}.{ours[-1].name}" if ours else "?"


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
