"""Tools the model may call, each a NATS request/reply endpoint.

Any process can offer a tool: it answers `tool.list` with its definitions and
`tool.call.<name>` with a `ToolOutcome`. Failures of every kind (no such tool,
timeout, a tool that raised) become a clear error text handed to the model,
which can then recover; they never fail the turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from pydantic import ValidationError

from schemas import subjects
from schemas.history import ChatMessage, ToolCall
from schemas.messages import ToolInvocation, ToolOutcome
from services.shared.bus import Bus, decode, headers_for
from services.shared.tool_catalogue import ToolCatalogue

log = structlog.get_logger()


@dataclass(frozen=True)
class ToolRun:
    message: ChatMessage
    timed_out: bool


class Toolbox:
    def __init__(self, bus: Bus, timeout_s: float) -> None:
        self._bus = bus
        self._timeout_s = timeout_s
        self._catalogue = ToolCatalogue(bus)

    async def definitions(self) -> list[dict[str, Any]]:
        """Ollama tool definitions offered by whoever answers `tool.list` (cached)."""
        return await self._catalogue.definitions()

    async def run(self, call: ToolCall, query_id: str, correlation_id: str,
                  session_id: str | None = None) -> ToolRun:
        try:
            content = await self._call(call, correlation_id, session_id)
            timed_out = False
        except NatsTimeout:
            content = f"error: tool '{call.name}' timed out after {self._timeout_s:g} s"
            timed_out = True
        message = ChatMessage(role="tool", content=content, tool_name=call.name,
                              query_id=query_id)
        return ToolRun(message, timed_out)

    async def _call(self, call: ToolCall, correlation_id: str, session_id: str | None) -> str:
        """The tool's output, or the error text the model gets; raises on timeout."""
        known = {d.get("function", {}).get("name") for d in await self.definitions()}
        if call.name not in known:
            return f"error: unknown tool '{call.name}'"
        try:
            subject = subjects.tool(call.name)
            env = self._bus.envelope(subject, ToolInvocation(name=call.name,
                                                             arguments=call.arguments),
                                     correlation_id=correlation_id,
                                     # Whose call it is: a tool such as recall
                                     # reads that session only, never another.
                                     session_id=session_id)
            msg = await self._bus.nc.request(subject, env.model_dump_json().encode(),
                                             timeout=self._timeout_s, headers=headers_for(env))
            outcome = decode(msg.data, ToolOutcome, subject).payload
        except NatsTimeout:
            raise  # `run` reports it, and the turn records a tool timeout
        except NoRespondersError:
            return f"error: tool '{call.name}' is not available right now"
        except (ValidationError, Exception) as err:  # a broken tool must not break the turn
            log.warning("tool_failed", tool=call.name, error=str(err))
            return f"error: tool '{call.name}' failed: {err}"
        if outcome.error is not None:
            return f"error: tool '{call.name}' failed: {outcome.error}"
        return outcome.content or ""
