"""A query's way through a generator, from its delivery to its reply.

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
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import structlog
from nats.aio.msg import Msg

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import ErrorCode, ErrorReport, Query, Reply
from services.core.failed_tries import Failure, TryAgain
from services.core.state_machine import Action
from services.generator.answered import AnsweredQueries, FailedTries, failure_of
from services.generator.arrival_order import ArrivalOrder, HandBacks
from services.generator.compaction import Compactor
from services.generator.head_start import HeadStart
from services.generator.session_lock import Lease, LockTimeout, SessionLocks
from services.generator.settings import GeneratorSettings
from services.generator.states import SessionStates
from services.generator.turn import TurnError
from services.generator.turns import FollowUp, TurnRunner
from services.shared import metrics
from services.shared.bus import MSG_ID_HEADER, BadMessage, Bus, decode, readable_id
from services.shared.consumer import Delivery, working_on
from services.shared.history_store import HistoryConflict
from services.shared.jetstream import NO_ROOM, QueuedQueries
from services.shared.nats_away import NATS_AWAY
from services.shared.query_errors import QueryErrors
from services.shared.sessions import SessionNotFound, SessionStore
from services.shared.together import together

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
# The server stamps a query's time, this process its own start of listening:
# a query stored up to this long after it is still read as maybe unheard.
STOP_CLOCK_MARGIN = timedelta(seconds=5)
log = structlog.get_logger()


class Room(Protocol):
    """What the process lends a query of its room for work (`slots.Slots`)."""

    def join_session(self, task: asyncio.Task[Any] | None, sid: str) -> None:
        """The task waits behind its session's own query: its slot is free."""

    def give_back(self, task: asyncio.Task[Any] | None) -> None:
        """The task's reply is out: what follows is bookkeeping."""

    def spawn_unslotted(self, work: Coroutine[Any, Any, None]) -> None:
        """Work after a turn (its report) that takes no slot."""


class Queries:
    """Each query delivered to this process, answered in its session's order
    under the session's lock, or handed back, or answered with an error."""

    def __init__(self, bus: Bus, settings: GeneratorSettings, locks: SessionLocks,
                 sessions: SessionStore, states: SessionStates, turns: TurnRunner,
                 compactor: Compactor, room: Room) -> None:
        self._bus = bus
        self._settings = settings
        self._locks = locks
        self._sessions = sessions
        self._states = states
        self._turns = turns
        self._compactor = compactor
        self._room = room
        self._arrival = ArrivalOrder()
        self._hand_backs = HandBacks(OUT_OF_ORDER_DELAY_S, OUT_OF_ORDER_MAX_DELAY_S)
        self.answered = AnsweredQueries()
        self._errors = QueryErrors(bus.js)
        self._failures = FailedTries(settings.nats_away_patience_s)
        self._hearing_stops_since = datetime.now(UTC)

    def hearing_stops(self) -> None:
        """From now on this process hears every stop (it began to listen, or
        NATS came back): see `_may_have_missed_a_stop`."""
        self._hearing_stops_since = datetime.now(UTC)

    async def handle(self, msg: Msg) -> None:
        try:
            env = decode(msg.data, Query, msg.subject)
        except BadMessage as err:
            await self._bus.report_bad_event(err)
            await self._refuse_malformed(msg, err.report)
            return
        sid = env.payload.session_id
        metrics.generator().query_received(env.timestamp, msg.metadata.num_delivered)
        self._room.join_session(asyncio.current_task(), sid)
        # Held from here to its reply: a stop meanwhile withdraws it, or is too late.
        with self._turns.stops.holding(env.message_id):
            await self._settle(msg, env, sid)

    async def _settle(self, msg: Msg, env: Envelope[Query], sid: str) -> None:
        async with working_on(msg, self._settings.query_ack_wait_s, session_id=sid,
                              correlation_id=env.correlation_id,
                              query_id=env.message_id) as delivery:
            async with self._arrival.turn(sid):
                try:
                    follow_up = await self._answer_in_order(delivery, env)
                except Exception as err:  # e.g. NATS away while taking the lock
                    await self._unexpected(delivery, env, err)
                    follow_up = None
            if follow_up is not None:  # outside the session's locks, and its slot
                self._room.spawn_unslotted(follow_up())

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
        reply = self.answered.error_reply(msg.metadata.sequence.stream, query_id)
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
        self.answered.remember(delivery.msg.metadata.sequence.stream, reply,
                                delivery.ack_confirmed(ACK_CONFIRM_S))
        sid = env.payload.session_id
        metrics.generator().turn_finished(env.timestamp, reply.error_code)
        await self._bus.publish(subjects.reply(sid), reply,
                                correlation_id=env.correlation_id, session_id=sid)
        self._room.give_back(asyncio.current_task())

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
        async for oldest in QueuedQueries(self._bus.js, sid, self._bus.fresh_reads_direct):
            seq = int(oldest.seq or 0)
            if seq >= ours:
                return None
            if not await self.answered.acknowledged(
                    seq, (oldest.headers or {}).get(MSG_ID_HEADER)):
                return seq
        return None


# Our helpers that only run requests handed to them: an error passing
# through one is named after the function that handed it the request.
PASS_THROUGH = frozenset({"together"})


def raised_in(err: BaseException) -> str:
    """The last of our functions the error passed through: which of a turn's
    NATS calls did not answer, where the error's type alone cannot say."""
    ours = [frame for frame in traceback.extract_tb(err.__traceback__)
            if f"{os.sep}services{os.sep}" in frame.filename
            and Path(frame.filename).stem not in PASS_THROUGH]
    return f"{Path(ours[-1].filename).stem}.{ours[-1].name}" if ours else "?"
