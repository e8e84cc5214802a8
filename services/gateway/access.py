"""The ASGI shell around `access_rules`: reads the facts of each request,
answers a refusal as JSON, serves CORS preflights for listed origins, turns
the page's `?token=` into a cookie, and holds a body to its size limit as it
is read (a missing or false Content-Length must not let it grow)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.core.numbers import whole_number
from services.gateway.access_rules import (
    TOKEN_COOKIE,
    Facts,
    Policy,
    Refusal,
    bearer,
    body_too_large,
    judge,
    preflight_allowed,
    token_matches,
)
from services.gateway.errors import HttpError, error

PREFLIGHT_MAX_AGE_S = 600


class BodyTooLarge(HttpError):
    def __init__(self, limit: int) -> None:
        super().__init__(refused(body_too_large(limit)))


def refused(refusal: Refusal) -> JSONResponse:
    return error(refusal.status, refusal.code, refusal.message)


class AccessGuard:
    def __init__(self, app: ASGIApp, policy: Policy) -> None:
        self._app = app
        self._policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request = Request(scope)
        headers = request.headers
        send = _framed_by_none(send)
        if request.method == "OPTIONS" and "access-control-request-method" in headers:
            await self._preflight(headers)(scope, receive, send)
            return
        page_token = request.query_params.get("token") if scope["path"] == "/" else None
        refusal = judge(facts_of(request, page_token), self._policy)
        if refusal:
            await refused(refusal)(scope, receive, send)
        elif page_token is not None:
            await token_cookie(self._kept(page_token))(scope, receive, send)
        else:
            await self._app(scope, self._limited(receive), self._with_cors(headers, send))

    def _kept(self, page_token: str) -> str | None:
        """The page's token, when it is the right one. The request may have
        been let in by a header or a cookie instead: an empty or wrong
        `?token=` must not overwrite a good cookie (the page would be locked
        out), nor a header's right carry a guess into one."""
        expected = self._policy.token
        return page_token if expected and token_matches(page_token, expected) else None

    def _preflight(self, headers: Headers) -> Response:
        origin = headers.get("origin")
        if not preflight_allowed(origin, self._policy):
            return refused(Refusal(403, "origin_not_allowed",
                                   f"no cross-origin requests from {origin!r}; "
                                   "GATEWAY_ALLOWED_ORIGINS lists the allowed ones"))
        return Response(status_code=204, headers={
            "access-control-allow-origin": str(origin),
            "access-control-allow-methods": "GET, POST, DELETE",
            "access-control-allow-headers": "authorization, content-type, accept, "
                                            "idempotency-key",
            "access-control-max-age": str(PREFLIGHT_MAX_AGE_S),
            "vary": "Origin",
        })

    def _with_cors(self, headers: Headers, send: Send) -> Send:
        origin = headers.get("origin")
        if not preflight_allowed(origin, self._policy):
            return send

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"access-control-allow-origin", str(origin).encode()),
                                      (b"vary", b"Origin")]
            await send(message)
        return send_with_cors

    def _limited(self, receive: Receive) -> Receive:
        limit = self._policy.max_body_bytes
        read = 0

        async def receive_limited() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > limit:
                raise BodyTooLarge(limit)
            return message
        return receive_limited


def facts_of(request: Request, page_token: str | None) -> Facts:
    # From the scope, not `request.url`: building the whole URL cost a fiftieth
    # of the gateway's CPU per request, for two parts the scope holds as they are.
    headers, scope = request.headers, request.scope
    length = headers.get("content-length", "")
    return Facts(
        method=request.method, path=scope["path"], scheme=scope.get("scheme", "http"),
        host=headers.get("host", ""), origin=headers.get("origin"),
        content_type=headers.get("content-type"),
        content_length=whole_number(length),
        token=bearer(headers.get("authorization")) or page_token
        or request.cookies.get(TOKEN_COOKIE),
    )


def token_cookie(token: str | None) -> Response:
    """The page's first visit, `/?token=…`: the token moves into a cookie
    scripts cannot read and other sites cannot send, and out of the address
    bar (and the browser's history)."""
    response = RedirectResponse("/", status_code=303)
    if token is not None:
        response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", path="/")
    return response


# No other site may show the page in a frame: its requests would carry the
# gateway's own Origin, and a user's clicks there would be the page's.
NOT_FRAMED = [(b"x-frame-options", b"DENY"),
              (b"content-security-policy", b"frame-ancestors 'none'"),
              (b"x-content-type-options", b"nosniff")]


def _framed_by_none(send: Send) -> Send:
    async def send_not_framed(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *NOT_FRAMED]
        await send(message)
    return send_not_framed

