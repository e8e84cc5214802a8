"""What the gateway answers when it cannot do what was asked: one JSON shape
for every refusal, `{"error": {"code", "message", ...}}`, and the exception
that carries one out of a handler."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from services.shared.jetstream import NO_ROOM


def error(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **extra}},
                        status_code=status)


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
