"""The tool definitions offered to the model: whatever answers `tool.list`,
cached for a while. The generator offers them with every call; the gateway
counts them in the page's gauge, as the generator's fit check does."""

from __future__ import annotations

import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas import subjects
from services.shared.bus import parse_json

DEFINITIONS_TTL_S = 30.0


class ToolCatalogue:
    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._definitions: list[dict[str, Any]] = []
        self._fetched_at = -DEFINITIONS_TTL_S

    async def definitions(self) -> list[dict[str, Any]]:
        """Ollama tool definitions (none while no tool answers)."""
        if time.monotonic() - self._fetched_at < DEFINITIONS_TTL_S:
            return self._definitions
        try:
            msg = await self._nc.request(subjects.TOOL_LIST, b"", timeout=0.5)
            loaded = parse_json(msg.data)
            self._definitions = loaded if isinstance(loaded, list) else []
        except (NatsTimeout, NoRespondersError, ValueError):
            self._definitions = []
        self._fetched_at = time.monotonic()
        return self._definitions
