"""HTTP routes. Each handler validates its input, turns it into a NATS
message, and turns what comes back into JSON (or server-sent events). A
message's question and answer go through `answering`; stop and retry live in
`controls`, the transcript's routes in `transcript`."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from nats.errors import NoRespondersError
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from schemas import subjects
from schemas.envelope import new_id
from schemas.messages import MAX_CONTENT_CHARS, CompactionRequest, Query, StateChange
from schemas.session import MAX_SYSTEM_PROMPT_CHARS, CompactionsRunning, SessionRecord
from services.core.context import next_prompt_tokens
from services.core.numbers import whole_number
from services.core.state_machine import Phase, session_state
from services.core.tokens import prompt_budget, stored_calibration
from services.gateway.answering import Answering, query_id_of
from services.gateway.bodies import parse_body
from services.gateway.controls import Controls
from services.gateway.errors import HttpError, error
from services.gateway.live import EventStream, ListenerLimit, LiveFeed
from services.gateway.replies import ReplyRouter
from services.gateway.settings import GatewaySettings
from services.gateway.transcript import TranscriptRoutes
from services.shared.bus import Bus, parse_json
from services.shared.history_store import HistoryStore
from services.shared.jetstream import missing
from services.shared.live_config import LiveSettings
from services.shared.nats_away import patiently
from services.shared.sessions import SessionNotFound, SessionStore
from services.shared.tool_catalogue import ToolCatalogue

STATIC = Path(__file__).parent / "static"
T = TypeVar("T")
Endpoint = Callable[[Request], Awaitable[Response]]
DEFAULT_LISTED = 50
MAX_LISTED = 500

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


def session_id_of(request: Request) -> str:
    sid = str(request.path_params["session_id"])
    if not subjects.is_valid_session_id(sid):
        raise HttpError(error(400, "invalid_session_id",
                              "session id must be 1-64 letters, digits, '-' or '_'"))
    return sid


class Api:
    def __init__(self, bus: Bus, tuning: LiveSettings[GatewaySettings], sessions: SessionStore,
                 history: HistoryStore, replies: ReplyRouter, live: LiveFeed) -> None:
        self._bus = bus
        # Read on every use: the compaction threshold may change while we run.
        self._tuning = tuning
        settings = tuning.current
        self._sessions = sessions
        self._history = history
        self._tools = ToolCatalogue(bus)
        self._replies = replies
        self._live = live
        self._listeners = ListenerLimit(settings.max_event_streams_per_client)
        self._known: set[str] = set()
        self._forgotten = 0  # deletes so far: a look-up that spans one adds nothing
        self._compactions: KeyValue | None = None
        self._transcript = TranscriptRoutes(bus, sessions, self._history, self._existing,
                                            self._forget)
        self._answering = Answering(bus, settings, history, replies)

    def routes(self) -> list[Route | Mount]:
        return [
            Route("/", self.index),
            Route("/healthz", self.healthz),
            Route("/api/sessions", self.create_session, methods=["POST"]),
            Route("/api/sessions", self._patient(self.list_sessions), methods=["GET"]),
            Route("/api/sessions/{session_id}", self._patient(self.get_session),
                  methods=["GET"]),
            Route("/api/sessions/{session_id}/messages", self.post_message, methods=["POST"]),
            Route("/api/sessions/{session_id}/compact", self.compact, methods=["POST"]),
            *[Route(r.path, self._patient(r.endpoint), methods=r.methods)
              if r.methods == {"GET", "HEAD"} else r for r in self._transcript.routes()],
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

    def _patient(self, read: Endpoint) -> Endpoint:
        """A read, tried again while NATS is away for a moment (a restart, a
        leader electing), so that 503 comes only after NATS_AWAY_PATIENCE_S,
        as for a message; a read is safe to run again."""
        async def patient_read(request: Request) -> Response:
            return await self.patiently(lambda: read(request), "read_tried_again")
        return patient_read

    async def patiently(self, attempt: Callable[[], Awaitable[T]], event: str) -> T:
        """`attempt`, tried again while NATS is away, for NATS_AWAY_PATIENCE_S
        or until the gateway stops; logged as `event` each time."""
        return await patiently(attempt, self._settings.nats_away_patience_s, event,
                               pause=self._replies.stopping_within)

    async def create_session(self, request: Request) -> Response:
        body = await parse_body(request, CreateSession, optional=True)
        record = SessionRecord(session_id=uuid.uuid4().hex, system=body.system,
                               model=body.model, auto_compact=body.auto_compact)
        await self.patiently(lambda: self._create(record), "session_create_tried_again")
        return JSONResponse({"session_id": record.session_id}, status_code=201)

    async def _create(self, record: SessionRecord) -> None:
        """Safe to try again: the id is new, so a record already under it is
        this very one, stored by a try whose answer was lost."""
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self._sessions.create(record)

    async def list_sessions(self, request: Request) -> Response:
        limit = whole_number(request.query_params.get("limit", str(DEFAULT_LISTED)), 1,
                             MAX_LISTED)
        if limit is None:
            return error(400, "invalid_field", f"limit: a whole number from 1 to {MAX_LISTED}",
                         field="limit")
        records = await self._sessions.newest(limit)
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
            "compacts_at": self._compacts_at(record),
            **await self._state(sid),
        })

    async def post_message(self, request: Request) -> Response:
        sid = session_id_of(request)
        body = await parse_body(request, PostMessage)
        await self.require_known(sid)
        return await self.answer(request, Query(session_id=sid, content=body.content))

    async def answer(self, request: Request, query: Query) -> Response:
        return await self._answering.answer(request, query)

    async def compact(self, request: Request) -> Response:
        sid = session_id_of(request)
        body = await parse_body(request, CompactBody, optional=True)
        await self.patiently(lambda: self.require_fresh(sid), "session_read_tried_again")
        request_id = new_id()  # offered again under one id, the stream keeps it once
        await self.patiently(lambda: self._bus.js_publish(
            subjects.COMPACTION_REQUEST,
            CompactionRequest(session_id=sid, auto=False, reason="requested by the user",
                              instructions=body.instructions),
            session_id=sid, message_id=request_id,
        ), "compaction_request_offered_again")
        return JSONResponse({"status": "compaction_requested"}, status_code=202)

    async def events(self, request: Request) -> Response:
        sid = request.query_params.get("session_id") or None  # empty: every session
        if sid is not None and not subjects.is_valid_session_id(sid):
            return error(400, "invalid_session_id", "invalid session_id parameter")
        client = request.client.host if request.client else ""
        release = self._listeners.admit(client)
        if release is None:
            return error(429, "too_many_streams", "this client has "
                         f"{self._settings.max_event_streams_per_client} event streams open "
                         "already (MAX_EVENT_STREAMS_PER_CLIENT)")
        return EventStream(self._live.stream(sid), release)

    async def _existing(self, request: Request) -> str:
        sid = session_id_of(request)
        await self._record(sid)
        return sid

    async def require_fresh(self, sid: str) -> None:
        """404 unless the session exists, read afresh: for the controls (compact,
        stop, retry), which no generator would refuse for a session another
        gateway deleted."""
        await self._record(sid)

    async def state(self, sid: str) -> dict[str, str]:
        return await self._state(sid)

    async def require_known(self, sid: str) -> None:
        """404 unless the session exists; once seen an id needs no further
        look-up until this gateway deletes it (another gateway's delete is
        answered `unknown_session` by the generator)."""
        if sid not in self._known:
            forgotten = self._forgotten
            # As patient as the message's publish: NATS away for a moment
            # answers 503 only after NATS_AWAY_PATIENCE_S.
            await self.patiently(lambda: self._record(sid), "session_read_tried_again")
            if self._forgotten == forgotten:  # no delete while it was read
                self._known.add(sid)

    def _forget(self, sid: str) -> None:
        self._forgotten += 1
        self._known.discard(sid)

    async def _record(self, sid: str) -> SessionRecord:
        try:
            return await self._sessions.get(sid)
        except SessionNotFound as err:
            raise HttpError(error(404, "unknown_session", f"session {sid} does not exist")) from err

    async def _state(self, sid: str) -> dict[str, str]:
        """The session's state, and the phase of its turn (what the state hides
        while a compaction runs). Read from the two records every generator
        writes to, not from whichever process published last."""
        (phase, since), compacting = await asyncio.gather(self._phase(sid),
                                                          self._compacting(sid))
        if phase is None:  # a record we cannot read
            return {"state": "compacting" if compacting else "unknown", "phase": "unknown"}
        return {"state": session_state(phase, compacting).value, "phase": phase.value, **since}

    async def _phase(self, sid: str) -> tuple[Phase | None, dict[str, str]]:
        """The phase of the session's last transition, and when and by which
        generator it was entered (`state_at`, `state_by`): the page passes
        over live changes from that generator older than it, which the feed
        may bring after a read that saw the turn end."""
        try:
            msg = await self._bus.js.get_last_msg(subjects.STATE_STREAM, subjects.state(sid),
                                                  direct=True)
        except NotFoundError:
            return Phase.idle, {}
        except NoRespondersError:
            # The stream is in memory: after a NATS restart it is missing
            # until a service makes it again, and then empty until the
            # session's next transition. Either way nothing is going on.
            if not await missing(self._bus.js, subjects.STATE_STREAM):
                raise
            return Phase.idle, {}
        try:
            envelope = parse_json(msg.data or b"{}")
            change = StateChange.model_validate(envelope["payload"])
            at = envelope.get("timestamp")
            since = {"state_at": at, "state_by": change.generator_id} if isinstance(at, str) else {}
            return Phase(change.to_state), since
        except (ValueError, KeyError, TypeError, AttributeError, ValidationError):
            return None, {}

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

    @property
    def _settings(self) -> GatewaySettings:
        return self._tuning.current

    def _budget(self, record: SessionRecord) -> int:
        return prompt_budget(self._num_ctx(record), self._settings.output_headroom)

    def _compacts_at(self, record: SessionRecord) -> int | None:
        """The estimate from which automatic compaction may begin (as the
        decider reads its threshold); None when it never does."""
        threshold = self._settings.compaction_threshold
        if not record.auto_compact or threshold <= 0:
            return None
        return math.ceil(threshold * self._budget(record))

    def reconnected(self) -> None:
        """NATS came back, perhaps without its store: ask it again which
        sessions exist and what their histories hold."""
        self._known.clear()
        self._history.forget_all()
