"""The tools process: answers `tool.list` with every definition and
`tool.call.<name>` with a `ToolOutcome`. Several copies can run: micro
endpoints share a queue group, so each call is answered once."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from nats.micro.request import Request

from schemas import subjects
from schemas.messages import ErrorReport, ToolInvocation, ToolOutcome
from services.shared.bus import BadMessage, Bus, decode
from services.shared.runner import Endpoint
from services.tools.catalogue import TOOLS, Tool, ToolFailure

log = structlog.get_logger()


class ToolsService:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._calls = 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def reconnected(self) -> None:
        return None  # its endpoints are plain subscriptions: nats-py renews them

    def status(self) -> dict[str, Any]:
        return {"tools": sorted(TOOLS), "calls": self._calls}

    def endpoints(self) -> list[Endpoint]:
        listing = Endpoint("list", subjects.TOOL_LIST, self._list)
        calls = [Endpoint(name, subjects.tool(name), self._caller(tool))
                 for name, tool in TOOLS.items()]
        return [listing, *calls]

    async def _list(self, request: Request) -> None:
        await request.respond(json.dumps([t.definition() for t in TOOLS.values()]).encode())

    def _caller(self, tool: Tool) -> Any:
        async def handle(request: Request) -> None:
            self._calls += 1
            try:
                env = decode(request.data, ToolInvocation, request.subject)
            except BadMessage as err:
                await request.respond(self._wrap(request.subject, err.report))
                return
            outcome = await asyncio.to_thread(run_tool, tool, env.payload.arguments)
            await request.respond(self._bus.envelope(
                request.subject, outcome, correlation_id=env.correlation_id
            ).model_dump_json().encode())
        return handle

    def _wrap(self, subject: str, report: ErrorReport) -> bytes:
        return self._bus.envelope(subject, report).model_dump_json().encode()


def run_tool(tool: Tool, arguments: dict[str, Any]) -> ToolOutcome:
    try:
        return ToolOutcome(name=tool.name, content=tool.run(**arguments))
    except ToolFailure as err:
        return ToolOutcome(name=tool.name, error=str(err))
    except TypeError as err:
        return ToolOutcome(name=tool.name, error=f"bad arguments: {err}")
    except Exception as err:  # a tool bug must reach the model as text, not kill us
        log.exception("tool_raised", tool=tool.name)
        return ToolOutcome(name=tool.name, error=f"{type(err).__name__}: {err}")
