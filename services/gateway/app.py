"""The gateway process: the Starlette app, served by uvicorn inside the same
event loop as the NATS connection."""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections.abc import Iterator
from typing import Any

import structlog
import uvicorn
from nats.js.errors import APIError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.access import AccessGuard
from services.gateway.access_rules import WILDCARD_BINDS, Policy, host_names, origins
from services.gateway.api import Api
from services.gateway.errors import STORAGE_FULL, HttpError, error, nats_away
from services.gateway.live import LiveFeed
from services.gateway.replies import ReplyRouter
from services.gateway.settings import GatewaySettings
from services.gateway.settings_watch import SettingsWatch
from services.shared import metrics
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore
from services.shared.jetstream import no_room
from services.shared.live_config import LiveSettings
from services.shared.nats_away import NATS_AWAY
from services.shared.query_errors import QueryErrors
from services.shared.runner import Endpoint
from services.shared.sessions import SessionStore

log = structlog.get_logger()
# After the answers in flight are settled, what is still being sent (a large
# export to a slow reader) gets this long before uvicorn cancels it.
LAST_RESPONSES_S = 2
# Any method name reaches us; only these are labels of their own.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def build_app(api: Api, policy: Policy) -> Starlette:
    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return exc.response

    async def on_no_route(request: Request, exc: Exception) -> Response:
        # An unknown path or method: JSON like every other error.
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "http_error"
        return error(exc.status_code, code, f"{request.method} {request.url.path}: {exc.detail}")

    async def on_nats_away(request: Request, exc: Exception) -> Response:
        log.warning("request_failed_nats_away", path=request.url.path,
                    error=f"{type(exc).__name__}: {exc}")
        return error(503, **nats_away(exc))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("request_failed", path=request.url.path)
        return error(500, "internal_error", f"{type(exc).__name__}: {exc}")

    async def on_refused(request: Request, exc: Exception) -> Response:
        if not no_room(exc):
            return await on_unexpected(request, exc)
        log.warning("request_failed_no_room", path=request.url.path, error=str(exc))
        return error(507, **STORAGE_FULL)

    return Starlette(
        routes=[*api.routes(), Route("/metrics", serve_metrics)],
        # Counted first, so refusals show in the metrics too.
        middleware=[Middleware(CountResponses), Middleware(AccessGuard, policy=policy)],
        exception_handlers={HttpError: on_http_error, HTTPException: on_no_route,
                            **dict.fromkeys(NATS_AWAY, on_nats_away),
                            APIError: on_refused, Exception: on_unexpected},
    )


async def serve_metrics(request: Request) -> Response:
    return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE)


class CountResponses:
    """Counts HTTP responses by method and status (both bounded sets)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
                metrics.gateway().http.labels(method, str(message["status"])).inc()
            await send(message)

        await self._app(scope, receive, counted)


class _Server(uvicorn.Server):
    # The service runner owns SIGTERM/SIGINT and stops us through should_exit.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Gateway:
    def __init__(self, bus: Bus, settings: GatewaySettings, api: Api,
                 replies: ReplyRouter, live: LiveFeed,
                 tuning: LiveSettings[GatewaySettings]) -> None:
        self._settings = settings
        self._watch = SettingsWatch(tuning)
        self._api = api
        self._replies = replies
        self._live = live
        config = uvicorn.Config(build_app(api, policy_of(settings)), host=settings.gateway_host,
                                port=settings.gateway_port, log_config=None,
                                access_log=False, lifespan="off",
                                # uvicorn's count starts as the stop does: it
                                # must outlast the waiting callers' grace.
                                timeout_graceful_shutdown=math.ceil(settings.stop_grace_s)
                                + LAST_RESPONSES_S)
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._watch.restart()
        await self._replies.start()
        await self._live.start()
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                await self._task  # raises the bind error
            await asyncio.sleep(0.02)
        log.info("http_listening", url=f"http://{self._settings.gateway_host}:"
                 f"{self._settings.gateway_port}")

    async def stop(self) -> None:
        """Stop taking connections, end the pages' event streams, give the
        callers still waiting a grace for their answers, then tell them; all
        well inside the runner's bound, so nobody's connection is just cut."""
        self._server.should_exit = True
        self._live.end_streams()
        await self._replies.stop_waiting(self._settings.stop_grace_s)
        if self._task:
            await self._task
        await self._replies.stop()
        await self._live.stop()
        await self._watch.stop()

    def endpoints(self) -> list[Endpoint]:
        return []

    async def reconnected(self) -> None:
        # Replies and the live feed are plain subscriptions: nats-py renews them,
        # but what was sent meanwhile is lost.
        self._api.reconnected()
        await self._replies.recover_missed()
        await self._watch.restart()  # the bucket may be gone with a lost store

    def status(self) -> dict[str, Any]:
        return {"http": f"{self._settings.gateway_host}:{self._settings.gateway_port}"}


def policy_of(settings: GatewaySettings) -> Policy:
    return Policy(allowed_hosts=host_names(settings.gateway_allowed_hosts, settings.gateway_host),
                  allowed_origins=origins(settings.gateway_allowed_origins),
                  token=settings.gateway_token, max_body_bytes=settings.max_body_bytes)


def with_token(settings: GatewaySettings) -> GatewaySettings:
    """`GATEWAY_TOKEN=auto`: a token made up for this run, and the page's
    address with it in the log, since nobody else knows it."""
    if settings.gateway_token != "auto":
        return settings
    token = secrets.token_urlsafe(32)
    host = "127.0.0.1" if settings.gateway_host in WILDCARD_BINDS else settings.gateway_host
    log.warning("gateway_token_made", page=f"http://{host}:{settings.gateway_port}/?token={token}")
    return settings.model_copy(update={"gateway_token": token})


async def build(bus: Bus, settings: GatewaySettings) -> Gateway:
    settings = with_token(settings)
    # Uncached: the page shows the generator's latest calibration.
    sessions = await SessionStore.open(bus.js, cached=False)
    # One view of the histories: the API's reads and the replies' recovery
    # after a reconnect, which the API's `reconnected` has just emptied.
    history = HistoryStore(bus.js)
    replies = ReplyRouter(bus, history, QueryErrors(bus.js))
    live = LiveFeed(bus.nc)
    tuning = LiveSettings(bus.js, settings, on_change=live.settings_changed)
    api = Api(bus, tuning, sessions, history, replies, live)
    return Gateway(bus, settings, api, replies, live, tuning)
