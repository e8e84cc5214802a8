"""The tools process: answers `tool.list` with every definition (a
`ToolDefinitions`) and `tool.call.<name>` with a `ToolOutcome`. Several copies
can run: micro endpoints share a queue group, so each call is answered once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import structlog
from nats.micro.request import Request

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import (
    Payload,
    ToolDefinitions,
    ToolInvocation,
    ToolListRequest,
    ToolOutcome,
)
from services.shared.bus import BadMessage, Bus, decode, headers_for
from services.shared.runner import Endpoint
from services.tools import recall
from services.tools.catalogue import TOOLS, Tool, ToolFailure

log = structlog.get_logger()

# A tool's work once its call is read, and the endpoint handler built around it.
Run = Callable[[Envelope[ToolInvocation]], Awaitable[ToolOutcome]]
Handler = Callable[[Request], Awaitable[None]]
P = TypeVar("P", bound=Payload)
# Calls answered at once by this process; past it, an endpoint reads the next
# call only when one ends.
MAX_CALLS_AT_ONCE = 64
# How long a stop waits for the calls under way to be answered.
STOP_WAIT_S = 5.0


class ToolsService:
    def __init__(self, bus: Bus, tools: Mapping[str, Tool] = TOOLS) -> None:
        self._bus = bus
        self._tools = tools
        self._calls = 0
        # A call is answered in a task of its own: nats-py hands an endpoint
        # its next request only once the handler returns, so one slow recall
        # held every other session's recall behind it, to their timeouts.
        self._room = asyncio.Semaphore(MAX_CALLS_AT_ONCE)
        self._under_way: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        """The calls under way are answered before the endpoints go, and so
        are those that come while it waits: the endpoints still take calls
        until then, and a call taken but never answered leaves its caller
        waiting out its whole timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_WAIT_S
        while self._under_way and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self._under_way), timeout=left)

    async def reconnected(self) -> None:
        return None  # its endpoints are plain subscriptions: nats-py renews them

    def status(self) -> dict[str, Any]:
        return {"tools": sorted([*self._tools, recall.NAME]), "calls": self._calls}

    def endpoints(self) -> list[Endpoint]:
        listing = Endpoint("list", subjects.TOOL_LIST,
                           self._replying(ToolListRequest, self._list))
        calls = [Endpoint(name, subjects.tool(name), self._answering(in_thread(tool)))
                 for name, tool in self._tools.items()]
        recalling = Endpoint(recall.NAME, subjects.tool(recall.NAME),
                             self._answering(self._recall))
        return [listing, *calls, recalling]

    async def _list(self, env: Envelope[ToolListRequest]) -> ToolDefinitions:
        return ToolDefinitions(tools=[*(t.definition() for t in self._tools.values()),
                                      recall.DEFINITION])

    async def _recall(self, env: Envelope[ToolInvocation]) -> ToolOutcome:
        try:
            return await recall.run_recall(self._bus.js, env.session_id, env.payload.arguments)
        except Exception as err:  # NATS away, a broken entry: text for the model
            log.exception("recall_failed")
            return ToolOutcome(name=recall.NAME, error=f"{type(err).__name__}: {err}")

    def _answering(self, run: Run) -> Handler:
        """One handler for every tool, counting its calls, each answered in
        a task of its own."""
        reply = self._replying(ToolInvocation, run)

        async def handle(request: Request) -> None:
            self._calls += 1
            await self._room.acquire()
            task = asyncio.create_task(self._released_after(reply(request)))
            self._under_way.add(task)
            task.add_done_callback(self._under_way.discard)
        return handle

    async def _released_after(self, call: Awaitable[None]) -> None:
        try:
            await call
        except Exception:  # no answer can go (NATS away): the caller times out
            log.exception("tool_call_not_answered")
        finally:
            self._room.release()

    def _replying(self, asked: type[P], work: Callable[[Envelope[P]], Awaitable[Payload]]
                  ) -> Handler:
        """A request that cannot be read is answered with a structured error,
        any other with what `work` makes of it, under the caller's
        correlation and session ids."""
        async def handle(request: Request) -> None:
            try:
                env = decode(request.data, asked, request.subject)
            except BadMessage as err:
                await self._bus.report_bad_event(err)  # logged and on system.error, as elsewhere
                await self._answer(request, err.report)
                return
            with structlog.contextvars.bound_contextvars(session_id=env.session_id,
                                                         correlation_id=env.correlation_id):
                answer = await work(env)
            await self._answer(request, answer, env)
        return handle

    async def _answer(self, request: Request, payload: Payload,
                      asked: Envelope[Any] | None = None) -> None:
        """The reply's envelope and tracing headers, under the ids of the
        request it answers."""
        env = self._bus.envelope(
            request.subject, payload, correlation_id=asked.correlation_id if asked else None,
            session_id=asked.session_id if asked else None)
        await request.respond(env.model_dump_json().encode(), headers=headers_for(env))


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
