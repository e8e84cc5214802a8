"""The tool definitions offered to the model, read from `tool.list` on a real NATS."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
from nats.aio.msg import Msg

from schemas import subjects
from services.shared.bus import Bus, round_trip
from services.shared.tool_catalogue import ToolCatalogue
from tests.events import eventually
from tests.nats_server import NatsServer
from tests.tools_offered import offer_tools


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object"}}}


def names(definitions: list[dict[str, Any]]) -> list[str]:
    return [definition["function"]["name"] for definition in definitions]


async def offers(catalogue: ToolCatalogue, wanted: list[str]) -> bool:
    return names(await catalogue.definitions()) == wanted


async def test_a_listing_not_answered_in_time_keeps_the_tools_offered_last(
        private_nats: NatsServer) -> None:
    """One slow answer was taken for a catalogue of no tools, and kept for the
    whole TTL: every tool read unknown meanwhile."""
    nc, first, second = [await nats.connect(private_nats.url) for _ in range(3)]
    try:
        catalogue = ToolCatalogue(Bus(nc, "test"), ttl_s=0, list_timeout_s=0.2,
                                  asked_again_after_s=0)
        await offer_tools(first, [tool("first")])
        # An answer may miss the short limit on a busy machine: asked again.
        await eventually(lambda: offers(catalogue, ["first"]), "the first tool offered")
        await first.close()
        heard = asyncio.Event()

        async def busy(msg: Msg) -> None:
            heard.set()  # and no answer

        quiet = await nc.subscribe(subjects.TOOL_LIST, cb=busy)
        await round_trip(nc)
        assert names(await catalogue.definitions()) == ["first"] and heard.is_set()
        await quiet.unsubscribe()
        await offer_tools(second, [tool("second")])
        await eventually(lambda: offers(catalogue, ["second"]), "the second tool offered")
    finally:
        for client in (nc, first, second):
            await client.close()


async def test_tools_back_after_none_answered_are_offered_at_once(
        private_nats: NatsServer) -> None:
    """With no tools service up (restarting), no tools were offered for the
    whole TTL after it was back."""
    nc, tools = [await nats.connect(private_nats.url) for _ in range(2)]
    try:
        catalogue = ToolCatalogue(Bus(nc, "test"), ttl_s=600, asked_again_after_s=0)
        assert await catalogue.definitions() == []
        await offer_tools(tools, [tool("back")])
        await eventually(lambda: offers(catalogue, ["back"]), "the tool offered again")
    finally:
        for client in (nc, tools):
            await client.close()
