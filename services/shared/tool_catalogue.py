"""The tool definitions offered to the model: whatever answers `tool.list`,
cached for a while. The generator offers them with every call; the gateway
counts them in the page's gauge, as the generator's fit check does."""

from __future__ import annotations

import time
from typing import Any

import structlog
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas import subjects
from schemas.messages import ToolDefinitions, ToolListRequest
from services.shared.bus import BadMessage, Bus, decode

DEFINITIONS_TTL_S = 30.0
log = structlog.get_logger()


class ToolCatalogue:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._definitions: list[dict[str, Any]] = []
        self._fetched_at = -DEFINITIONS_TTL_S

    async def definitions(self) -> list[dict[str, Any]]:
        """Ollama tool definitions (none while no tool answers, or its answer
        cannot be read)."""
        if time.monotonic() - self._fetched_at < DEFINITIONS_TTL_S:
            return self._definitions
        try:
            msg = await self._bus.request(subjects.TOOL_LIST, ToolListRequest(), timeout_s=0.5)
            self._definitions = decode(msg.data, ToolDefinitions, subjects.TOOL_LIST).payload.tools
        except (NatsTimeout, NoRespondersError):
            self._definitions = []
        except BadMessage as err:
            log.warning("tool_list_unreadable", error=err.report.message)
            self._definitions = []
        self._fetched_at = time.monotonic()
        return self._definitions
