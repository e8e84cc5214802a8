"""The tools process: answers `tool.list` with every definition (a
`ToolDefinitions`) and `tool.call.<name>` with a `ToolOutcome`. Several copies
can run: micro endpoints share a queue group, so each call is answered once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.micro.request import Request

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import (
    ErrorReport,
    ToolDefinitions,
    ToolInvocation,
    ToolListRequest,
    ToolOutcome,
)
from services.shared.bus import BadMessage, Bus, decode
from services.shared.runner import Endpoint
from services.tools import recall
from services.tools.catalogue import TOOLS, Tool, ToolFailure

log = structlog.get_logger()

# A tool's work once its call is read, and the endpoint handler built around it.
Run = Callable[[Envelope[ToolInvocation]], Awaitable[ToolOutcome]]
Handler = Callable[[Request], Awaitable[None]]


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
        return {"tools": sorted([*TOOLS, recall.NAME]), "calls": self._calls}

    def endpoints(self) -> list[Endpoint]:
        listing = Endpoint("list", subjects.TOOL_LIST, self._list)
        calls = [Endpoint(name, subjects.tool(name), self._answering(in_thread(tool)))
                 for name, tool in TOOLS.items()]
        recalling = Endpoint(recall.NAME, subjects.tool(recall.NAME),
                             self._answering(self._recall))
        return [listing, *calls, recalling]

    async def _list(self, request: Request) -> None:
        try:
            env = decode(request.data, ToolListRequest, request.subject)
        except BadMessage as err:
            await request.respond(self._wrap(request.subject, err.report))
            return
        listing = ToolDefinitions(tools=[*(t.definition() for t in TOOLS.values()),
                                         recall.DEFINITION])
        await request.respond(self._bus.envelope(
            request.subject, listing, correlation_id=env.correlation_id
        ).model_dump_json().encode())

    async def _recall(self, env: Envelope[ToolInvocation]) -> ToolOutcome:
        try:
            return await recall.run_recall(self._bus.js, env.session_id, env.payload.arguments)
        except Exception as err:  # NATS away, a broken entry: text for the model
            log.exception("recall_failed")
            return ToolOutcome(name=recall.NAME, error=f"{type(err).__name__}: {err}")

    def _answering(self, run: Run) -> Handler:
        """One handler for every tool: a call that cannot be read is answered
        with a structured error, any other with the tool's outcome, under the
        caller's correlation and session ids."""
        async def handle(request: Request) -> None:
            self._calls += 1
            try:
                env = decode(request.data, ToolInvocation, request.subject)
            except BadMessage as err:
                await request.respond(self._wrap(request.subject, err.report))
                return
            outcome = await run(env)
            await request.respond(self._bus.envelope(
                request.subject, outcome, correlation_id=env.correlation_id,
                session_id=env.session_id).model_dump_json().encode())
        return handle

    def _wrap(self, subject: str, report: ErrorReport) -> bytes:
        return self._bus.envelope(subject, report).model_dump_json().encode()


def in_thread(tool: Tool) -> Run:
    """A catalogue tool is plain code, some of it slow: it runs off the loop."""
    async def run(env: Envelope[ToolInvocation]) -> ToolOutcome:
        return await asyncio.to_thread(run_tool, tool, env.payload.arguments)
    return run


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
