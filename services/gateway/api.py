"""HTTP routes. Each handler validates its input, turns it into a NATS
message, and turns what comes back into JSON (or server-sent events)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import structlog
from nats.errors import NoRespondersError
from nats.js.api import PubAck
from nats.js.errors import APIError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from schemas import subjects
from schemas.messages import MAX_CONTENT_CHARS, CompactionRequest, Query, Reply, StateChange
from schemas.session import MAX_SYSTEM_PROMPT_CHARS, CompactionsRunning, SessionRecord
from services.core.context import next_prompt_tokens
from services.core.state_machine import Phase, session_state
from services.core.tokens import prompt_budget, stored_calibration
from services.gateway.controls import Controls
from services.gateway.idempotency import HEADER as KEY_HEADER
from services.gateway.idempotency import (
    InvalidKey,
    KeyReused,
    earlier_outcome,
    key_of,
    query_id_for,
)
from services.gateway.live import ListenerLimit, LiveFeed
from services.gateway.replies import GatewayStopping, ReplyRouter, Waiting, events_until_reply
from services.gateway.settings import GatewaySettings
from services.gateway.transcript import TranscriptRoutes
from services.shared.bus import Bus, parse_json
from services.shared.history_store import HistoryStore
from services.shared.jetstream import NO_ROOM, missing, no_room
from services.shared.nats_away import NATS_AWAY, patiently
from services.shared.sessions import SessionNotFound, SessionStore
from services.shared.tool_catalogue import ToolCatalogue

STATIC = Path(__file__).parent / "static"
DEFAULT_LISTED = 50
MAX_LISTED = 500

# Generator error codes -> HTTP status.
ERROR_STATUS = {
    "unknown_session": 404,
    "context_overflow": 413,
    "compacting": 409,
    "already_answered": 409,
    "failed_before": 409,
    "unreachable": 502,
    "provider_error": 502,
    "empty_reply": 502,
    # Ollama's own status for a model it has not pulled.
    "model_not_found": 404,
    "timeout": 504,
    "tool_loop_limit": 502,
    "nothing_to_retry": 409,
    "retry_outdated": 409,
    "storage_full": 507,
    "nats_unavailable": 503,
}


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system: str = Field(default="", max_length=MAX_SYSTEM_PROMPT_CHARS)
    model: str | None = Field(default=None, min_length=1, max_length=200)
    auto_compact: bool = True


class PostMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    content: str = Field(min_length=1, max_length=MAX_CONTENT_CHARS)


class CompactBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instructions: str | None = Field(default=None, max_length=4000)


def error(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **extra}},
                        status_code=status)


KEY_REUSED = {"code": "idempotency_key_reused",
              "message": "this Idempotency-Key was sent before with another message; "
                         "a new message needs a new key"}
STOPPING = {"code": "gateway_stopping",
            "message": "the gateway is stopping before the answer came; the query stays "
                       "queued, and its answer will be in the session's history"}
STORAGE_FULL = {"code": "storage_full", "message": f"nothing was stored: {NO_ROOM}"}


def nats_away(exc: Exception) -> dict[str, str]:
    return {"code": "nats_unavailable", "message": "NATS is unreachable or not ready "
            f"({type(exc).__name__}); try again in a moment"}


class HttpError(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M], optional: bool = False) -> M:
    raw = await request.body()
    if not raw.strip() and optional:
        return model()
    try:
        data = parse_json(raw)
    except ValueError as err:
        raise HttpError(error(400, "invalid_json", f"body is not valid JSON: {err}")) from err
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or "(body)"
        raise HttpError(error(422, "invalid_field", f"{field}: {first['msg']}",
                              field=field)) from err


def query_id_of(request: Request, sid: str, retry: bool) -> str | None:
    """The query's id for the caller's `Idempotency-Key`; None without one."""
    try:
        key = key_of(request.headers.get(KEY_HEADER))
    except InvalidKey as err:
        raise HttpError(error(400, "invalid_idempotency_key", str(err))) from err
    return None if key is None else query_id_for(sid, key, retry)


def session_id_of(request: Request) -> str:
    sid = str(request.path_params["session_id"])
    if not subjects.is_valid_session_id(sid):
        raise HttpError(error(400, "invalid_session_id",
                              "session id must be 1-64 letters, digits, '-' or '_'"))
    return sid


class Api:
    def __init__(self, bus: Bus, settings: GatewaySettings, sessions: SessionStore,
                 history: HistoryStore, replies: ReplyRouter, live: LiveFeed) -> None:
        self._bus = bus
        self._settings = settings
        self._sessions = sessions
        self._history = history
        self._tools = ToolCatalogue(bus.nc)
        self._replies = replies
        self._live = live
        self._listeners = ListenerLimit(settings.max_event_streams_per_client)
        self._known: set[str] = set()
        self._compactions: KeyValue | None = None
        self._transcript = TranscriptRoutes(bus, sessions, self._history, self._existing,
                                            self._known.discard)

    def routes(self) -> list[Route | Mount]:
        return [
            Route("/", self.index),
            Route("/healthz", self.healthz),
            Route("/api/sessions", self.create_session, methods=["POST"]),
            Route("/api/sessions", self.list_sessions, methods=["GET"]),
            Route("/api/sessions/{session_id}", self.get_session, methods=["GET"]),
            Route("/api/sessions/{session_id}/messages", self.post_message, methods=["POST"]),
            Route("/api/sessions/{session_id}/compact", self.compact, methods=["POST"]),
            *self._transcript.routes(),
            *Controls(self._bus, self._history, self, session_id_of, query_id_of).routes(),
            Route("/api/events", self.events, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]

    async def index(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def healthz(self, request: Request) -> Response:
        if self._bus.connected:
            return JSONResponse({"status": "ok", "nats": "connected"})
        return JSONResponse({"status": "unavailable", "nats": "disconnected"}, status_code=503)

    async def create_session(self, request: Request) -> Response:
        body = await parse_body(request, CreateSession, optional=True)
        record = SessionRecord(session_id=uuid.uuid4().hex, system=body.system,
                               model=body.model, auto_compact=body.auto_compact)
        await self._sessions.create(record)
        return JSONResponse({"session_id": record.session_id}, status_code=201)

    async def list_sessions(self, request: Request) -> Response:
        raw = request.query_params.get("limit", str(DEFAULT_LISTED))
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LISTED:
            return error(400, "invalid_field", f"limit: a whole number from 1 to {MAX_LISTED}",
                         field="limit")
        records = await self._sessions.newest(int(raw))
        return JSONResponse({"sessions": [
            {"session_id": r.session_id, "created_at": r.created_at.isoformat(),
             "model": r.model_or(self._settings.model), "auto_compact": r.auto_compact}
            for r in records]})

    async def get_session(self, request: Request) -> Response:
        record = await self._record(session_id_of(request))
        sid = record.session_id
        view = await self._history.read(sid)
        # Tokens in the context, as compaction results and the decider count them.
        tokens = next_prompt_tokens(record.system, view.conversation,
                                    await self._tools.definitions(),
                                    stored_calibration(record))
        return JSONResponse({
            "session_id": sid,
            "system": record.system,
            "model": record.model_or(self._settings.model),
            "auto_compact": record.auto_compact,
            "summary": view.conversation.summary,
            "compactions": view.conversation.compactions,
            "messages": [m.model_dump(exclude_defaults=True) for m in view.conversation.messages],
            "token_count": tokens,
            "num_ctx": self._num_ctx(record),
            "budget": self._budget(record),
            **await self._state(sid),
        })

    async def post_message(self, request: Request) -> Response:
        sid = session_id_of(request)
        body = await parse_body(request, PostMessage)
        await self._require(sid)
        return await self.answer(request, Query(session_id=sid, content=body.content))

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
            except KeyReused:
                return error(422, **KEY_REUSED)
            if earlier is not None:
                return self._reply_response(earlier)
            try:
                async for event in events_until_reply(waiting.events,
                                                      self._settings.reply_timeout_s):
                    if isinstance(event, Reply):
                        return self._reply_response(event)
            except TimeoutError:
                pass
            except GatewayStopping:
                return error(503, **STOPPING)
        return error(504, "timeout", "no answer from a generator in time; the query stays "
                     "queued and will be answered when a generator is available")

    async def _ask(self, query: Query, waiting: Waiting, keyed: bool) -> Reply | None:
        """Send the query; None when its reply is to come to `waiting`. For a
        query sent before under its key, what became of it: asked after the
        reply is expected, so one sent meanwhile is not missed either way."""
        if keyed and (earlier := await self._earlier(query, waiting.query_id)) is not None:
            return earlier
        ack = await self._submit(query, waiting)
        if not (keyed and ack.duplicate) or await self._still_queued(ack.seq):
            return None  # new, or the first sending is still to be answered
        # The first sending is done with, but this request came too late for its reply.
        return await self._earlier(query, waiting.query_id) or Reply(
            session_id=query.session_id, query_id=waiting.query_id, error_code="failed_before",
            error="the message sent before under this Idempotency-Key got an error reply "
                  "that this gateway did not see; send it again under a new key")

    async def _earlier(self, query: Query, query_id: str) -> Reply | None:
        """What the history, or a remembered error reply, says of this query."""
        sid = query.session_id
        conversation = (await self._history.read(sid)).conversation
        return (earlier_outcome(conversation, sid, query_id, query.content)
                or self._replies.failure(query_id))

    async def _still_queued(self, seq: int) -> bool:
        try:
            await self._bus.js.get_msg(subjects.QUERIES_STREAM, seq, direct=True)
        except NotFoundError:
            return False
        return True

    async def _stream_answer(self, query: Query, query_id: str | None) -> AsyncIterator[str]:
        with self._replies.expect(query.session_id, query_id) as waiting:
            try:
                earlier = await self._ask(query, waiting, keyed=query_id is not None)
            except KeyReused:
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
            async for event in events_until_reply(waiting.events,
                                                  self._settings.reply_timeout_s):
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
            yield sse("error", {"error": {"code": "timeout", "message": "no answer in time"}})
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
        return ack

    async def compact(self, request: Request) -> Response:
        sid = session_id_of(request)
        body = await parse_body(request, CompactBody, optional=True)
        await self._require(sid)
        await self._bus.js_publish(
            subjects.COMPACTION_REQUEST,
            CompactionRequest(session_id=sid, auto=False, reason="requested by the user",
                              instructions=body.instructions),
            session_id=sid,
        )
        return JSONResponse({"status": "compaction_requested"}, status_code=202)

    async def events(self, request: Request) -> Response:
        sid = request.query_params.get("session_id") or None  # empty: every session
        if sid is not None and not subjects.is_valid_session_id(sid):
            return error(400, "invalid_session_id", "invalid session_id parameter")
        client = request.client.host if request.client else ""
        stream = self._listeners.admit(client, self._live.stream(sid))
        if stream is None:
            return error(429, "too_many_streams", "this client has "
                         f"{self._settings.max_event_streams_per_client} event streams open "
                         "already (MAX_EVENT_STREAMS_PER_CLIENT)")
        return StreamingResponse(stream, media_type="text/event-stream")

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
        body: dict[str, Any] = {"session_id": reply.session_id, "reply": reply.reply,
                                "prompt_tokens": reply.prompt_tokens,
                                "completion_tokens": reply.completion_tokens}
        if reply.thinking:
            body["thinking"] = reply.thinking
        if reply.stopped:
            body["stopped"] = True
        return body

    async def _existing(self, request: Request) -> str:
        sid = session_id_of(request)
        await self._record(sid)
        return sid

    async def require(self, sid: str) -> None:
        await self._require(sid)

    async def state(self, sid: str) -> dict[str, str]:
        return await self._state(sid)

    async def _require(self, sid: str) -> None:
        """404 unless the session exists; once seen an id needs no further
        look-up until this gateway deletes it (another gateway's delete is
        answered `unknown_session` by the generator)."""
        if sid not in self._known:
            await self._record(sid)
            self._known.add(sid)

    async def _record(self, sid: str) -> SessionRecord:
        try:
            return await self._sessions.get(sid)
        except SessionNotFound as err:
            raise HttpError(error(404, "unknown_session", f"session {sid} does not exist")) from err

    async def _state(self, sid: str) -> dict[str, str]:
        """The session's state, and the phase of its turn (what the state hides
        while a compaction runs). Read from the two records every generator
        writes to, not from whichever process published last."""
        phase, compacting = await asyncio.gather(self._phase(sid), self._compacting(sid))
        if phase is None:  # a record we cannot read
            return {"state": "compacting" if compacting else "unknown", "phase": "unknown"}
        return {"state": session_state(phase, compacting).value, "phase": phase.value}

    async def _phase(self, sid: str) -> Phase | None:
        try:
            msg = await self._bus.js.get_last_msg(subjects.STATE_STREAM, subjects.state(sid),
                                                  direct=True)
        except NotFoundError:
            return Phase.idle
        except NoRespondersError:
            # The stream is in memory: after a NATS restart it is missing
            # until a service makes it again, and then empty until the
            # session's next transition. Either way nothing is going on.
            if not await missing(self._bus.js, subjects.STATE_STREAM):
                raise
            return Phase.idle
        try:
            change = StateChange.model_validate(parse_json(msg.data or b"{}")["payload"])
            return Phase(change.to_state)
        except (ValueError, KeyError, TypeError, ValidationError):
            return None

    async def _compacting(self, sid: str) -> bool:
        try:
            if self._compactions is None:
                self._compactions = await self._bus.js.key_value(
                    subjects.COMPACTIONS_RUNNING_BUCKET)
            entry = await self._compactions.get(sid)
        except (NotFoundError, NoRespondersError):
            return False  # no record (or no bucket since NATS came back): nothing runs
        try:
            return bool(CompactionsRunning.model_validate_json(entry.value or b"{}").running)
        except ValidationError:
            return False

    def _num_ctx(self, record: SessionRecord) -> int:
        return record.window(self._settings.num_ctx)

    def _budget(self, record: SessionRecord) -> int:
        return prompt_budget(self._num_ctx(record), self._settings.output_headroom)

    def reconnected(self) -> None:
        """NATS came back, perhaps without its store: ask it again which
        sessions exist and what their histories hold."""
        self._known.clear()
        self._history.forget_all()


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
