"""A request's JSON body, read into its pydantic model or answered with a
clear error: 400 for what is not JSON, 422 naming the first field wrong."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from services.gateway.errors import HttpError, error
from services.shared.bus import parse_json

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
