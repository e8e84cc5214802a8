"""The NATS side of every service: connect, wrap payloads in envelopes,
publish them (core or JetStream) with tracing headers, and validate what
arrives.

Correlation and session ids ride in headers as well as in the envelope, so
`nats sub --headers` shows them, with a W3C `traceparent` derived from the
correlation id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from pydantic import ValidationError

from schemas import subjects
from schemas.envelope import MAX_ID_CHARS, Envelope, enveloped, new_id
from schemas.messages import ErrorReport, Payload
from services.shared.nats_auth import inbox_prefix
from services.shared.settings import nats_servers, shown_url

P = TypeVar("P", bound=Payload)
log = structlog.get_logger()

CORRELATION_HEADER = "Correlation-Id"
SESSION_HEADER = "Session-Id"
MSG_ID_HEADER = "Nats-Msg-Id"
_TRACE_ID = re.compile("[0-9a-f]{32}")


class BadMessage(Exception):
    """A message that does not match its schema; carries the structured error."""

    def __init__(self, report: ErrorReport) -> None:
        super().__init__(report.message)
        self.report = report


def parse_json(data: bytes | str) -> Any:
    """`json.loads`, with a document nested too deep to parse reported as the
    ValueError it is: the parser raises RecursionError (not a ValueError) for
    one nested some thousands deep, which a handler catching bad JSON misses."""
    try:
        return json.loads(data)
    except RecursionError as err:
        raise ValueError("JSON nested too deeply to parse") from err


def decode(data: bytes, payload_type: type[P], subject: str) -> Envelope[P]:
    try:
        env = enveloped(payload_type).model_validate_json(data)
    except ValidationError as err:
        raise BadMessage(validation_report(err, subject)) from err
    _check_session(env, subject)
    return env


def _check_session(env: Envelope[Any], subject: str) -> None:
    """A message names the session of the subject it came on, if any, in its
    payload and envelope: one on `chat.query.A` for B wrote a turn into B,
    past B's queue and a delete of B; one on `chat.stop.A` stopped B."""
    in_payload = getattr(env.payload, "session_id", None)
    expected = subjects.session_in(subject) or in_payload
    if expected is None:
        return
    for field, named in (("payload.session_id", in_payload), ("session_id", env.session_id)):
        if named is not None and named != expected:
            raise BadMessage(ErrorReport(
                code="invalid_message", subject=subject,
                message=f"{field} is {named}, but the message is for session {expected}",
                details=[{"field": field, "error": f"not the session {expected}"}]))


def readable_id(data: bytes) -> str | None:
    """The `message_id` of a message that does not validate, when it has a
    usable one: what its answer can be addressed to."""
    try:
        message = parse_json(data)
    except ValueError:
        return None
    found = message.get("message_id") if isinstance(message, dict) else None
    return found if isinstance(found, str) and 0 < len(found) <= MAX_ID_CHARS else None


def validation_report(err: ValidationError, subject: str | None) -> ErrorReport:
    details = [
        {"field": ".".join(str(p) for p in e["loc"]), "error": e["msg"]}
        for e in err.errors(include_url=False, include_input=False)
    ]
    fields = ", ".join(d["field"] or "(message)" for d in details)
    return ErrorReport(
        code="invalid_message",
        message=f"message does not match its schema: {fields}",
        subject=subject,
        details=details,
    )


def traceparent(correlation_id: str) -> str | None:
    """A W3C trace context whose trace id is the correlation id, when it fits.
    The span id need only be unique, not secret: no system call per message."""
    if not _TRACE_ID.fullmatch(correlation_id):
        return None
    return f"00-{correlation_id}-{random.getrandbits(64) | 1:016x}-01"


async def connect(url: str, name: str, timeout_s: float = 2.0,
                  on_reconnect: Callable[[], Awaitable[None]] | None = None,
                  options: Mapping[str, Any] | None = None) -> NATS:
    """Connect, retrying until NATS answers; afterwards nats-py reconnects
    forever, to any server `url` lists (comma-separated) or the cluster
    announces, and calls `on_reconnect` each time it has."""
    delay = 0.2
    while True:
        try:
            return await nats.connect(
                nats_servers(url),
                name=name,
                inbox_prefix=inbox_prefix(name),
                connect_timeout=timeout_s,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                error_cb=_on_error,
                disconnected_cb=_on_disconnect,
                reconnected_cb=on_reconnect or _on_reconnect,
                **(options or {}),  # credentials (nats_auth)
            )
        except (OSError, TimeoutError, nats.errors.NoServersError) as err:
            log.warning("nats_connect_failed", url=shown_url(url), error=str(err),
                        retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def round_trip(nc: NATS, timeout_s: float = 5.0) -> None:
    """Returns once what this connection sent before has reached the server:
    a message to ourselves comes back only after it.

    Not `nc.flush()`, for two reasons (nats-py 2.16). Its PING is written
    straight to the socket, ahead of commands still in the client's pending
    buffer, so it may return before a subscription made just before has
    reached the server: a watcher would miss the first message. And a flush
    cancelled (its caller gone) or timed out while its PONG is on the way
    leaves a cancelled future in nats-py's queue, whose result set when the
    PONG comes ends the connection's read loop for good."""
    inbox = nc.new_inbox()
    echo = await nc.subscribe(inbox, max_msgs=1)
    try:
        await nc.publish(inbox, b"")
        await echo.next_msg(timeout=timeout_s)
    finally:
        with contextlib.suppress(Exception):
            await echo.unsubscribe()


_REFUSED = "authorization violation"
_CREDENTIAL_SETTINGS = "NATS_URL, NATS_USER/NATS_PASSWORD, NATS_TOKEN or NATS_CREDS"
_TLS_SETTINGS = "NATS_TLS_CA, NATS_TLS_CERT, NATS_TLS_KEY"
# How nats-py passes on the server's refusal (lower-cased, subject quoted).
_DENIED = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')


async def _on_error(err: Exception) -> None:
    """Refusals are errors naming what to fix; the client goes on trying
    meanwhile, since the server's users may be fixed without a restart here."""
    denied = _DENIED.search(str(err))
    if denied:  # this service's NATS user lacks a right it needs (nats-users.conf)
        log.error("nats_permission_denied", operation=denied[1], subject=denied[2])
    elif isinstance(err, nats.errors.AuthorizationError) or _REFUSED in str(err).lower():
        log.error("nats_credentials_refused", error=str(err), settings=_CREDENTIAL_SETTINGS)
    elif isinstance(err, ssl.SSLError):
        log.error("nats_tls_failed", error=str(err), settings=_TLS_SETTINGS)
    else:
        log.warning("nats_error", error=str(err))


async def _on_disconnect() -> None:
    log.warning("nats_disconnected")


async def _on_reconnect() -> None:
    log.info("nats_reconnected")


class Bus:
    """One service's connection, with its sender id stamped on what it sends."""

    def __init__(self, nc: NATS, sender_id: str, replicas: int = 1) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.sender_id = sender_id
        # A direct get may be answered by any replica, one behind the leader
        # included: a read that must see what was just stored (is a query
        # still queued?) asks the leader when there are replicas.
        self.fresh_reads_direct = replicas == 1

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    def envelope(
        self,
        subject: str,
        payload: P,
        *,
        correlation_id: str | None = None,
        session_id: str | None = None,
        message_id: str | None = None,
    ) -> Envelope[P]:
        return enveloped(type(payload))(
            message_id=message_id or new_id(),
            message_type=payload.MESSAGE_TYPE,
            subject=subject,
            sender_id=self.sender_id,
            correlation_id=correlation_id or new_id(),
            session_id=session_id,
            payload=payload,
        )

    async def publish(
        self,
        subject: str,
        payload: Payload,
        *,
        correlation_id: str | None = None,
        session_id: str | None = None,
        reply: str = "",
        message_id: str | None = None,
    ) -> Envelope[Any]:
        """A core publish. With `message_id` (also sent as Nats-Msg-Id) for a
        subject a stream captures, it is stored once however often it is
        sent, and nothing waits for the stream's acknowledgement."""
        env = self.envelope(subject, payload, correlation_id=correlation_id,
                            session_id=session_id, message_id=message_id)
        headers = headers_for(env, stored_once=message_id is not None)
        await self.nc.publish(subject, _encode(env), reply=reply, headers=headers)
        return env

    async def js_publish(
        self,
        subject: str,
        payload: Payload,
        *,
        correlation_id: str | None = None,
        session_id: str | None = None,
        message_id: str | None = None,
        timeout_s: float = 5.0,
    ) -> tuple[Envelope[Any], PubAck]:
        """Publish into a stream; the envelope's message id doubles as Nats-Msg-Id,
        so a retried publish is stored once."""
        env = self.envelope(
            subject,
            payload,
            correlation_id=correlation_id,
            session_id=session_id,
            message_id=message_id,
        )
        headers = headers_for(env, stored_once=True)
        ack = await self.js.publish(subject, _encode(env), timeout=timeout_s, headers=headers)
        return env, ack

    async def request(self, subject: str, payload: Payload, *, timeout_s: float,
                      session_id: str | None = None) -> Msg:
        """A core NATS request; raises TimeoutError (or NoRespondersError) if
        nobody answers."""
        env = self.envelope(subject, payload, session_id=session_id)
        return await self.nc.request(subject, _encode(env), timeout=timeout_s,
                                     headers=headers_for(env))

    async def respond(self, msg: Msg, payload: Payload, *, correlation_id: str | None = None,
                      session_id: str | None = None) -> None:
        env = self.envelope(msg.reply, payload, correlation_id=correlation_id,
                            session_id=session_id)
        await self.nc.publish(msg.reply, _encode(env), headers=headers_for(env))

    async def decode_or_report(self, msg: Msg, payload_type: type[P]) -> Envelope[P] | None:
        """The validated message, or None after reporting it as malformed."""
        try:
            return decode(msg.data, payload_type, msg.subject)
        except BadMessage as err:
            await self.report_bad_event(err)
            return None

    async def decode_or_refuse(self, msg: Msg, payload_type: type[P]) -> Envelope[P] | None:
        """A core request's validated message, or None after answering the
        requester with the structured error (and reporting it as an event)."""
        try:
            return decode(msg.data, payload_type, msg.subject)
        except BadMessage as err:
            await self.report_bad_event(err)
            if msg.reply:
                await self.respond(msg, err.report)
            return None

    async def report_bad_event(self, err: BadMessage) -> None:
        """Log a malformed event and make it visible on the error subject."""
        log.warning("bad_message", subject=err.report.subject, error=err.report.message,
                    details=err.report.details)
        await self.publish(subjects.ERROR_SUBJECT, err.report)


def headers_for(env: Envelope[Any], stored_once: bool = False) -> dict[str, str]:
    """Tracing headers; `stored_once` adds the message id as Nats-Msg-Id, so a
    stream keeps a message sent again only once."""
    headers = {CORRELATION_HEADER: env.correlation_id}
    if stored_once:
        headers[MSG_ID_HEADER] = env.message_id
    if env.session_id:
        headers[SESSION_HEADER] = env.session_id
    trace = traceparent(env.correlation_id)
    if trace:
        headers["traceparent"] = trace
    return headers


def _encode(env: Envelope[Any]) -> bytes:
    return env.model_dump_json().encode()
