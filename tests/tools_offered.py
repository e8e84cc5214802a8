"""Tools of a test's own on real NATS: `tool.list` answered the way the tools
service answers it."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import ToolDefinitions
from services.shared.bus import Bus, round_trip


async def offer_tools(nc: NATS, definitions: list[dict[str, Any]]) -> None:
    """Answer every `tool.list` request on `nc` with `definitions`."""
    bus = Bus(nc, "tools")

    async def listing(msg: Msg) -> None:
        await msg.respond(bus.envelope(msg.subject, ToolDefinitions(tools=definitions))
                          .model_dump_json().encode())

    await nc.subscribe(subjects.TOOL_LIST, cb=listing)
    await round_trip(nc)  # offered at the server before anyone asks
