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
# A tools service that answered nothing in time (busy, starting), or none
# there, is asked again this soon; meanwhile the tools it offered last (or
# none) are offered.
LIST_TIMEOUT_S = 2.0
ASKED_AGAIN_AFTER_S = 1.0
log = structlog.get_logger()


class ToolCatalogue:
    def __init__(self, bus: Bus, ttl_s: float = DEFINITIONS_TTL_S,
                 list_timeout_s: float = LIST_TIMEOUT_S,
                 asked_again_after_s: float = ASKED_AGAIN_AFTER_S) -> None:
        self._bus = bus
        self._ttl_s = ttl_s
        self._list_timeout_s = list_timeout_s
        self._asked_again_after_s = asked_again_after_s
        self._definitions: list[dict[str, Any]] = []
        self._ask_at = 0.0  # when the next call asks `tool.list` again

    async def definitions(self) -> list[dict[str, Any]]:
        """Ollama tool definitions (none while no tool answers, or its answer
        cannot be read)."""
        now = time.monotonic()
        if now < self._ask_at:
            return self._definitions
        self._ask_at = now + self._ttl_s
        try:
            msg = await self._bus.request(subjects.TOOL_LIST, ToolListRequest(),
                                          timeout_s=self._list_timeout_s)
            self._definitions = decode(msg.data, ToolDefinitions, subjects.TOOL_LIST).payload.tools
        except NatsTimeout:
            # Not a catalogue of no tools: for a whole TTL, every tool would
            # read unknown after one slow answer.
            log.warning("tool_list_not_answered", offered_still=len(self._definitions))
            self._ask_at = now + self._asked_again_after_s
        except NoRespondersError:
            # No tools service (restarting, say): none offered, but not for a
            # whole TTL after it is back.
            self._definitions = []
            self._ask_at = now + self._asked_again_after_s
        except BadMessage as err:
            log.warning("tool_list_unreadable", error=err.report.message)
            self._definitions = []
        return self._definitions
