"""HTTP routes for a session's transcript: paging, export, and delete.

Delete removes the record first, so every endpoint (and any generator that
looks the session up afresh) answers 404 / `unknown_session` from then on,
then answers and purges the queued queries, then purges the history subject
(transcript and context), the state, the lock and the compaction record. A
delete cut short after the record went is finished by the next one."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import structlog
from nats.errors import NoRespondersError
from nats.js.errors import KeyNotFoundError, NotFoundError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import ErrorCode, Query, Reply, SessionDeleted
from services.core.transcript import InvalidCursor, Position, page_limit
from services.gateway.errors import HttpError, error
from services.shared.bus import Bus, decode
from services.shared.history_store import HistoryStore
from services.shared.jetstream import QueuedQueries
from services.shared.nats_away import NATS_AWAY
from services.shared.sessions import SessionStore
from services.shared.transcript import json_export, markdown_export, page, page_before

log = structlog.get_logger()
Check = Callable[[Request], Awaitable[str]]


class TranscriptRoutes:
    def __init__(self, bus: Bus, sessions: SessionStore, history: HistoryStore,
                 existing: Check, forget: Callable[[str], None]) -> None:
        self._bus = bus
        self._sessions = sessions
        self._history = history
        # The session id of the request, or a 404 / 400 raised.
        self._existing = existing
        self._forget = forget

    def routes(self) -> list[Route]:
        return [
            Route("/api/sessions/{session_id}/transcript", self.transcript, methods=["GET"]),
            Route("/api/sessions/{session_id}/export", self.export, methods=["GET"]),
            Route("/api/sessions/{session_id}", self.delete, methods=["DELETE"]),
        ]

    async def transcript(self, request: Request) -> Response:
        sid = await self._existing(request)
        try:
            limit = page_limit(request.query_params.get("limit"))
        except ValueError as err:
            return error(400, "invalid_field", str(err), field="limit")
        params = request.query_params
        kind = params.get("kind")
        if kind not in (None, "message", "compaction"):
            return error(400, "invalid_field", "kind: message or compaction", field="kind")
        try:
            after = _cursor(params.get("after"), "after")
            before = _cursor(params.get("before"), "before")
        except InvalidCursor as err:
            return error(400, "invalid_field", str(err), field=str(err).split(":")[0])
        if "before" in params and "after" in params:
            return error(400, "invalid_field", "before: not with after", field="before")
        if "before" in params:
            items, earlier = await page_before(self._bus.js, sid, before, limit, kind)
            return JSONResponse({"session_id": sid, "items": [i.as_json() for i in items],
                                 "previous": _text(earlier), "next": None})
        items, following = await page(self._bus.js, sid, after, limit, kind)
        return JSONResponse({"session_id": sid, "items": [i.as_json() for i in items],
                             "next": _text(following)})

    async def export(self, request: Request) -> Response:
        sid = await self._existing(request)
        form = request.query_params.get("format", "markdown")
        if form not in ("markdown", "json"):
            return error(400, "invalid_field", "format: markdown or json", field="format")
        # Sent as it is read: a long transcript never sits whole in memory.
        if form == "json":
            return StreamingResponse(json_export(self._bus.js, sid),
                                     media_type="application/json",
                                     headers=_download(f"session-{sid}.json"))
        return StreamingResponse(markdown_export(self._bus.js, sid),
                                 media_type="text/markdown; charset=utf-8",
                                 headers=_download(f"session-{sid}.md"))

    async def delete(self, request: Request) -> Response:
        try:
            sid = await self._existing(request)
        except HttpError as err:
            # No record: 404, unless an earlier delete stopped after removing
            # it (NATS went away mid-way); this one finishes that delete.
            sid = str(request.path_params["session_id"])
            if err.response.status_code != 404 or not await self._left_behind(sid):
                raise
            log.warning("session_delete_finished", session_id=sid)
        else:
            await self._sessions.delete(sid)
        self._forget(sid)
        await self._answer_queued(sid)
        js = self._bus.js
        for stream, subject in ((subjects.QUERIES_STREAM, subjects.query(sid)),
                                (subjects.HISTORY_STREAM, subjects.history(sid)),
                                (subjects.STATE_STREAM, subjects.state(sid))):
            await js.purge_stream(stream, subject=subject)
        for bucket in (subjects.LOCKS_BUCKET, subjects.COMPACTIONS_RUNNING_BUCKET):
            kv = await js.key_value(bucket)
            with contextlib.suppress(KeyNotFoundError, NotFoundError):
                await kv.purge(sid)
        self._history.forget(sid)
        log.info("session_deleted", session_id=sid)
        # Told, not kept: a page that misses it finds the session gone on its next read.
        with contextlib.suppress(*NATS_AWAY):
            await self._bus.publish(subjects.session_deleted(sid), SessionDeleted(session_id=sid),
                                    session_id=sid)
        return Response(status_code=204)

    async def _left_behind(self, sid: str) -> bool:
        """Whether a session whose record is gone still has its transcript or
        queued queries stored. (Not its last state: a compaction ending after
        the delete may announce one, and that is no reason to say 204 twice.)"""
        for stream, subject in ((subjects.HISTORY_STREAM, subjects.history(sid)),
                                (subjects.QUERIES_STREAM, subjects.query(sid))):
            # No stream at all (NATS back without its store): nothing left either.
            with contextlib.suppress(NotFoundError, NoRespondersError):
                await self._bus.js.get_last_msg(stream, subject,
                                                direct=self._bus.fresh_reads_direct)
                return True
        return False

    async def _answer_queued(self, sid: str) -> None:
        """Each query still queued gets its answer: the session is gone."""
        async for msg in QueuedQueries(self._bus.js, sid, self._bus.fresh_reads_direct):
            try:
                env: Envelope[Query] = decode(msg.data or b"", Query, msg.subject or "")
            except Exception:  # a malformed query is purged all the same
                continue
            await self._bus.publish(subjects.reply(sid), Reply(
                session_id=sid, query_id=env.message_id, error_code=ErrorCode.unknown_session,
                error=f"session {sid} was deleted"), correlation_id=env.correlation_id,
                session_id=sid)


def _cursor(raw: str | None, name: str) -> Position | None:
    """A cursor parameter; `before=end` (or empty) is the transcript's end."""
    if not raw or (name == "before" and raw == "end"):
        return None
    try:
        return Position.parse(raw)
    except InvalidCursor as err:
        raise InvalidCursor(f"{name}: use a 'next' or 'previous' of a page") from err


def _text(position: Position | None) -> str | None:
    return str(position) if position is not None else None


def _download(name: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{name}"'}
