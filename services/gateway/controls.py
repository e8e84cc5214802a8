"""The controls of a running chat: stop the answer being written (or
withdraw a message still waiting for its turn), and ask for a fresh answer
to the last message.

A stop is a core NATS request on `chat.stop.<session>`: every generator
hears it, and only the one running the session's answer, or holding the
named query, replies (and stops it, or promises to withdraw it). No reply in
time means none holds it: a message still queued is then withdrawn here."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import nats
import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from schemas import subjects
from schemas.history import Conversation
from schemas.messages import ErrorCode, Query, Reply, StopAccepted, StopRequest
from services.core.retry import RetryPoint, RetryRefused, retry_verdict
from services.core.state_machine import Phase
from services.gateway.bodies import parse_body
from services.gateway.errors import HttpError, error
from services.shared.bus import BadMessage, Bus, decode
from services.shared.history_store import HistoryStore
from services.shared.jetstream import QueuedQueries
from services.shared.query_errors import WITHDRAWN_TEXT, QueryErrors

# How long the process running the answer has to say it is stopping it. A
# generator answers from its event loop at once; silence means none runs it.
STOP_ANSWER_S = 1.0
QUIET_PHASES = (Phase.idle.value, Phase.error.value)
log = structlog.get_logger()
T = TypeVar("T")
# A bound on the queued queries read for one session's retry.
MAX_QUEUED_READ = 256


class Answers(Protocol):
    async def require_fresh(self, sid: str) -> None: ...

    async def patiently(self, attempt: Callable[[], Awaitable[T]], event: str) -> T: ...

    async def state(self, sid: str) -> dict[str, str]: ...

    async def answer(self, request: Request, query: Query) -> Response: ...


class StopBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    retry: bool = False  # the key named a retry, not a message


def conflict(code: str, message: str) -> JSONResponse:
    return error(409, code, message)


class Controls:
    def __init__(self, bus: Bus, history: HistoryStore, answers: Answers,
                 session_id_of: Callable[[Request], str],
                 query_id_of: Callable[[Request, str, bool], str | None]) -> None:
        self._bus = bus
        self._session_id_of = session_id_of
        self._query_id_of = query_id_of
        self._history = history
        self._answers = answers
        self._errors = QueryErrors(bus.js)

    def routes(self) -> list[Route]:
        return [
            Route("/api/sessions/{session_id}/stop", self.stop, methods=["POST"]),
            Route("/api/sessions/{session_id}/retry", self.retry, methods=["POST"]),
        ]

    async def stop(self, request: Request) -> Response:
        """The session's answer being written; under an `Idempotency-Key`,
        only the answer to the message (or, `{"retry": true}`, the retry)
        sent under it."""
        sid = self._session_id_of(request)
        body = await parse_body(request, StopBody, optional=True)
        query_id = self._query_id_of(request, sid, body.retry)
        await self._answers.require_fresh(sid)
        accepted = await self._ask_to_stop(sid, query_id)
        if accepted is not None and accepted.status == "stopping":
            return JSONResponse({"status": "stopping", "session_id": sid,
                                 "query_id": accepted.query_id,
                                 "generator_id": accepted.generator_id}, status_code=202)
        may_wait = accepted is None or accepted.status == "withdrawing"
        if query_id is not None and may_wait and await self._withdraw(
                sid, query_id, held=accepted is not None):
            return JSONResponse({"status": "withdrawn", "session_id": sid,
                                 "query_id": query_id}, status_code=202)
        whose = "this session" if query_id is None else "this message"
        return conflict("nothing_running", f"no answer is being written for {whose} "
                        "(it may have just been written)")

    async def _ask_to_stop(self, sid: str, query_id: str | None) -> StopAccepted | None:
        """What the generator running or holding the query says; None when
        none answers in time (none holds it)."""
        try:
            msg = await self._bus.request(
                subjects.stop(sid), StopRequest(session_id=sid, query_id=query_id),
                timeout_s=STOP_ANSWER_S, session_id=sid)
        except (NatsTimeout, NoRespondersError, TimeoutError):
            return None
        return decode(msg.data, StopAccepted, msg.subject).payload

    async def _withdraw(self, sid: str, query_id: str, held: bool) -> bool:
        """Whether the query, which no process is answering, is withdrawn: one
        still waiting for its turn is now, and its caller told at once, not
        once the answers before it end. Every generator heard the stop: one
        holding the query (`held`) has promised to withdraw it, as would any
        other it came to. One that may have missed the stop (started since)
        reads the error reply kept here; and the query leaves the queue, so
        that none started later, or after the holder died, can take it."""
        waiting = await self._waiting(sid, query_id)
        if waiting is None:  # a generator withdrew it, or answered it
            return await self._kept_withdrawn(query_id)
        seq, question = waiting
        reply = Reply(session_id=sid, query_id=query_id, error=WITHDRAWN_TEXT,
                      error_code=ErrorCode.withdrawn)
        if not await self._errors.keep(reply, question, first=True):
            return await self._kept_withdrawn(query_id)  # it failed with an error of its own
        if not await self._taken_out(seq) and not held:
            # Settled meanwhile: answered after all, or withdrawn by a generator.
            conversation = (await self._history.read(sid)).conversation
            return (conversation.answered(sid, query_id) is None
                    and await self._kept_withdrawn(query_id))
        await self._bus.publish(subjects.reply(sid), reply, session_id=sid)
        return True

    async def _kept_withdrawn(self, query_id: str) -> bool:
        kept = await self._errors.reply_of(query_id)
        return kept is not None and kept.error_code == ErrorCode.withdrawn

    async def _waiting(self, sid: str, query_id: str) -> tuple[int, str] | None:
        """The stream sequence and message of the query if it is queued and not
        answered yet (the work queue drops a query a moment after its
        acknowledgement)."""
        async for msg in QueuedQueries(self._bus.js, sid, self._bus.fresh_reads_direct):
            with contextlib.suppress(BadMessage):
                query = decode(msg.data or b"", Query, subjects.query(sid))
                if query.message_id == query_id:
                    conversation = (await self._history.read(sid)).conversation
                    if conversation.answered(sid, query_id) is not None:
                        return None
                    return int(msg.seq or 0), query.payload.content
        return None

    async def _taken_out(self, seq: int) -> bool:
        """Whether the query is out of the queue: then no generator started
        since, however long none runs, can take it. False when it had gone
        already (answered meanwhile). Not taken out (a users file without the
        right), it is withdrawn all the same: the generators heard the stop,
        and one started since reads the error reply kept for it."""
        try:
            await self._bus.js.delete_msg(subjects.QUERIES_STREAM, seq)
        except NotFoundError:
            return False
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("withdrawn_query_left_queued", error=f"{type(err).__name__}: {err}")
        return True

    async def retry(self, request: Request) -> Response:
        sid = self._session_id_of(request)
        ours = self._query_id_of(request, sid, True)
        # Reads only: tried again while NATS is away, as a message's are.
        point = await self._answers.patiently(lambda: self._retry_point(sid, ours),
                                              "retry_read_tried_again")
        # The answer it replaces goes with it: a retry asked at the same moment
        # from another tab, of the same answer, is then refused, not taken twice.
        return await self._answers.answer(request, Query(
            session_id=sid, content=point.context.messages[-1].content, retry=True,
            replacing=point.supersedes or ""))

    async def _retry_point(self, sid: str, ours: str | None) -> RetryPoint:
        """The message a retry answers again, and the answer it replaces; a 404
        or 409 when there is none, or the session is answering another."""
        await self._answers.require_fresh(sid)
        conversation = (await self._history.read(sid)).conversation
        done = ours is not None and conversation.answered(sid, ours) is not None
        if not done and await self._busy(sid, conversation, ours):
            raise HttpError(conflict("turn_running", "the session is answering a message; "
                                     "stop it or wait for its answer, then retry"))
        point = retry_verdict(conversation)
        if isinstance(point, RetryRefused):
            raise HttpError(conflict(point.code, point.message))
        return point

    async def _busy(self, sid: str, conversation: Conversation, ours: str | None) -> bool:
        """A turn under way, or a query waiting for its turn in the queue; not
        when this retry, sent before under its key, is queued (its resend
        waits for that answer, whatever was sent after it). The work queue
        drops a query a moment after its acknowledgement: one whose answer is
        stored already, or whose error reply is kept (a failure, a
        withdrawal), is done."""
        queued = await self._queued(sid)
        if ours is not None and ours in queued:
            return False
        if (await self._answers.state(sid))["phase"] not in QUIET_PHASES:
            return True
        answered = {m.query_id for m in conversation.messages}
        for query_id in queued:
            if query_id not in answered and await self._errors.reply_of(query_id) is None:
                return True
        return False

    async def _queued(self, sid: str) -> list[str]:
        """The ids of the session's queries in the queue, oldest first (a
        session has few: each waits for the one before it)."""
        queued: list[str] = []
        async for msg in QueuedQueries(self._bus.js, sid, self._bus.fresh_reads_direct):
            with contextlib.suppress(BadMessage):  # not a query any generator will answer
                queued.append(decode(msg.data or b"", Query, subjects.query(sid)).message_id)
            if len(queued) >= MAX_QUEUED_READ:
                break
        return queued
