"""Asking a question and hearing its answer: the query published into the
QUERIES work queue, then the generator's reply (and streamed tokens) waited
for and turned into JSON or server-sent events. Under an `Idempotency-Key`,
a query sent before is not sent again: its caller hears what became of it
(`services.gateway.idempotency`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import structlog
from nats.js.api import PubAck
from nats.js.errors import APIError, NotFoundError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from schemas import subjects
from schemas.messages import ErrorCode, Query, Reply
from services.gateway import idempotency
from services.gateway.errors import STOPPING, STORAGE_FULL, HttpError, error, nats_away
from services.gateway.live import KEEPALIVE_S
from services.gateway.replies import (
    GatewayStopping,
    ReplyRouter,
    Waiting,
    reply_within,
    streamed_events,
)
from services.gateway.settings import GatewaySettings
from services.shared.bus import BadMessage, Bus, decode
from services.shared.history_store import HistoryStore
from services.shared.jetstream import no_room
from services.shared.nats_away import NATS_AWAY, patiently

# The HTTP status of each error a reply may carry (another's code reads as 500).
ERROR_STATUS: dict[str, int] = {
    ErrorCode.unknown_session: 404,
    ErrorCode.context_overflow: 413,
    ErrorCode.compacting: 409,
    ErrorCode.already_answered: 409,
    ErrorCode.failed_before: 409,
    ErrorCode.unreachable: 502,
    ErrorCode.provider_error: 502,
    ErrorCode.empty_reply: 502,
    # Ollama's own status for a model it has not pulled.
    ErrorCode.model_not_found: 404,
    ErrorCode.timeout: 504,
    ErrorCode.tool_loop_limit: 502,
    ErrorCode.internal_error: 500,
    ErrorCode.nothing_to_retry: 409,
    ErrorCode.retry_outdated: 409,
    ErrorCode.storage_full: 507,
    ErrorCode.nats_unavailable: 503,
    ErrorCode.invalid_message: 400,
    ErrorCode.withdrawn: 409,
}
log = structlog.get_logger()
# What a caller the gateway stopped waiting for may do (`reply_timeout`, not the
# model's `timeout`: that one is an answer, an error, and nothing was stored):
# its query is answered all the same.
STILL_QUEUED = ("the query stays queued and will be answered into the session's history; "
                "sent again under the same Idempotency-Key, it returns that answer")
KEY_REUSED = {"code": "idempotency_key_reused",
              "message": "this Idempotency-Key was sent before with another message; "
                         "a new message needs a new key"}


def query_id_of(request: Request, sid: str, retry: bool) -> str | None:
    """The query's id for the caller's `Idempotency-Key`; None without one."""
    try:
        key = idempotency.key_of(request.headers.get(idempotency.HEADER))
    except idempotency.InvalidKey as err:
        raise HttpError(error(400, "invalid_idempotency_key", str(err))) from err
    return None if key is None else idempotency.query_id_for(sid, key, retry)


class Answering:
    def __init__(self, bus: Bus, settings: GatewaySettings, history: HistoryStore,
                 replies: ReplyRouter) -> None:
        self._bus = bus
        self._settings = settings
        self._history = history
        self._replies = replies

    async def answer(self, request: Request, query: Query) -> Response:
        """Submit the query; its answer as server-sent events if the caller
        accepts them, else as one JSON reply. Under an `Idempotency-Key`, a
        query sent before is not sent again: its caller hears what became
        of it (`services.gateway.idempotency`)."""
        query_id = query_id_of(request, query.session_id, query.retry)
        if "text/event-stream" in request.headers.get("accept", ""):
            streamed = query.model_copy(update={"stream": True})
            return StreamingResponse(self._stream_answer(streamed, query_id),
                                     media_type="text/event-stream")
        with self._replies.expect(query.session_id, query_id) as waiting:
            try:
                earlier = await self._ask(query, waiting, keyed=query_id is not None)
            except idempotency.KeyReused:
                return error(422, **KEY_REUSED)
            if earlier is not None:
                return self._reply_response(earlier)
            try:
                return self._reply_response(
                    await reply_within(waiting.events, self._settings.reply_timeout_s))
            except TimeoutError:
                pass
            except GatewayStopping:
                return error(503, **STOPPING)
        return error(504, "reply_timeout",
                     f"no answer from a generator in time; {STILL_QUEUED}")

    async def _ask(self, query: Query, waiting: Waiting, keyed: bool) -> Reply | None:
        """Send the query; None when its reply is to come to `waiting`. For a
        query sent before under its key, what became of it: asked after the
        reply is expected, so one sent meanwhile is not missed either way."""
        if keyed and (earlier := await self._earlier(query, waiting.query_id)) is not None:
            return earlier
        ack = await self._submit(query, waiting)
        if not (keyed and ack.duplicate):
            return None  # new
        queued, first = await self._queued(ack.seq)
        if queued:  # still to be answered: its reply will come here too
            idempotency.same_message(first, query.content)
            log.info("resend_waits_for_first", session_id=query.session_id,
                     query_id=waiting.query_id)
            return None
        # The first sending is done with, but this request came too late for its reply.
        if (earlier := await self._earlier(query, waiting.query_id, errors=True)) is not None:
            return earlier
        log.warning("resend_outcome_unknown", session_id=query.session_id,
                    query_id=waiting.query_id)
        return Reply(
            session_id=query.session_id, query_id=waiting.query_id, error_code="failed_before",
            error="the message sent before under this Idempotency-Key got an error reply "
                  "that is no longer kept; send it again under a new key")

    async def _earlier(self, query: Query, query_id: str, errors: bool = False
                       ) -> Reply | None:
        """What the history, and with `errors` a kept error reply, says of this
        query. (Errors are kept only while the stream drops a resend as a
        duplicate: before a publish, one kept would be found after it anyway.)"""
        sid = query.session_id
        # As patient as the publish after it: NATS away for a moment answers
        # 503 only after NATS_AWAY_PATIENCE_S, keyed or not.
        view = await patiently(lambda: self._history.read(sid),
                               self._settings.nats_away_patience_s, "history_read_tried_again",
                               pause=self._replies.stopping_within)
        earlier = idempotency.earlier_outcome(view.conversation, sid, query_id, query.content)
        if earlier is None and errors:
            earlier = idempotency.kept_outcome(await self._replies.error_of(query_id),
                                               query.content)
        if earlier is not None:
            log.info("resend_answered_before", session_id=sid, query_id=query_id,
                     error_code=earlier.error_code)
        return earlier

    async def _queued(self, seq: int) -> tuple[bool, str | None]:
        """Whether the query at `seq` still waits in the QUERIES stream, and
        its message (None if it does not read as a query: another gateway's make)."""
        try:
            msg = await self._bus.js.get_msg(subjects.QUERIES_STREAM, seq,
                                             direct=self._bus.fresh_reads_direct)
        except NotFoundError:
            return False, None
        try:
            return True, decode(msg.data or b"", Query, subjects.QUERIES_STREAM).payload.content
        except BadMessage:
            return True, None

    async def _stream_answer(self, query: Query, query_id: str | None) -> AsyncIterator[str]:
        with self._replies.expect(query.session_id, query_id) as waiting:
            try:
                earlier = await self._ask(query, waiting, keyed=query_id is not None)
            except idempotency.KeyReused:
                yield sse("error", {"error": KEY_REUSED, "session_id": query.session_id})
                return
            except NATS_AWAY as err:  # the stream is under way: say it as its end
                yield sse("error", {"error": nats_away(err), "session_id": query.session_id})
                return
            except APIError as err:
                if not no_room(err):
                    raise
                yield sse("error", {"error": STORAGE_FULL, "session_id": query.session_id})
                return
            if earlier is not None:
                yield sse("error" if earlier.error else "done", self._reply_body(earlier))
                return
            async for event in self._streamed_events(waiting):
                yield event

    async def _streamed_events(self, waiting: Waiting) -> AsyncIterator[str]:
        next_index = 0
        try:
            async for event in streamed_events(waiting.events, self._settings.reply_timeout_s,
                                               KEEPALIVE_S):
                if event is None:
                    yield ": keep-alive\n\n"
                    continue
                if isinstance(event, Reply):
                    yield sse("error" if event.error else "done", self._reply_body(event))
                    continue
                if event.index < next_index:
                    # The query was redelivered (its generator died mid-answer)
                    # and the answer starts over: drop what was shown.
                    yield sse("restart", {"reason": "the answer is being generated again"})
                next_index = event.index + 1
                yield sse("token", {"text": event.text, "index": event.index})
        except TimeoutError:
            yield sse("error", {"error": {"code": "reply_timeout",
                                          "message": f"no answer in time; {STILL_QUEUED}"},
                                "session_id": waiting.sid})
        except GatewayStopping:
            yield sse("error", {"error": STOPPING, "session_id": waiting.sid})

    async def _submit(self, query: Query, waiting: Waiting) -> PubAck:
        """Publish the query. While NATS does not take it (its stream electing
        a leader), it is offered again under the same id, which the stream
        keeps once, for NATS_AWAY_PATIENCE_S or until the gateway stops."""
        sid, correlation_id = query.session_id, waiting.correlation_id
        with structlog.contextvars.bound_contextvars(session_id=sid,
                                                     correlation_id=correlation_id):
            _, ack = await patiently(lambda: self._bus.js_publish(
                subjects.query(sid), query, correlation_id=correlation_id,
                session_id=sid, message_id=waiting.query_id),
                self._settings.nats_away_patience_s, "query_offered_again",
                pause=self._replies.stopping_within)
        waiting.stored = True
        return ack

    def _reply_response(self, reply: Reply) -> JSONResponse:
        body = self._reply_body(reply)
        if reply.error:
            return JSONResponse(body, status_code=ERROR_STATUS.get(reply.error_code or "", 500))
        return JSONResponse(body)

    @staticmethod
    def _reply_body(reply: Reply) -> dict[str, Any]:
        if reply.error:
            return {"error": {"code": reply.error_code, "message": reply.error},
                    "session_id": reply.session_id}
        body: dict[str, Any] = {"session_id": reply.session_id, "query_id": reply.query_id,
                                "reply": reply.reply, "prompt_tokens": reply.prompt_tokens,
                                "completion_tokens": reply.completion_tokens}
        if reply.thinking:
            body["thinking"] = reply.thinking
        if reply.stopped:
            body["stopped"] = True
        return body


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
