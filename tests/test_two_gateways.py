"""Two gateway processes on one NATS serve the same sessions: a query asked
through one while the live events are watched through the other, and every
reply reaches the gateway that asked, never its twin."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.nats_server import NatsServer, free_port
from tests.system import System, gateway_client


@pytest.fixture
async def gateways(private_nats: NatsServer, stub_url: str
                   ) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    second_port = free_port()
    system = System(private_nats.url, stub_url)
    system.add("second gateway", "services.gateway", {"GATEWAY_PORT": str(second_port)})
    system.start()
    try:
        async with system.http(timeout=30) as first, \
                gateway_client(f"http://127.0.0.1:{second_port}", timeout=30) as second:
            yield first, second
    finally:
        system.stop()


async def create(http: httpx.AsyncClient) -> str:
    response = await http.post("/api/sessions", json={})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


async def test_a_query_through_one_gateway_shows_live_on_the_other(
        gateways: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    asking, watching = gateways
    sid = await create(asking)
    async with watching.stream("GET", "/api/events", params={"session_id": sid},
                               timeout=httpx.Timeout(30, read=None)) as live:
        lines = live.aiter_lines()
        assert (await anext(lines)).startswith(": connected")
        answer = await asking.post(f"/api/sessions/{sid}/messages",
                                   json={"content": "asked through the first"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["reply"] == "Echo: asked through the first (turn 1)"
        async with asyncio.timeout(20):
            async for line in lines:  # the turn's report, relayed by the other gateway
                if line.startswith("data: ") and json.loads(line[6:])["message_type"] \
                        == "response.generation":
                    assert json.loads(line[6:])["session_id"] == sid
                    break
    seen = (await watching.get(f"/api/sessions/{sid}")).json()
    assert seen["messages"][0]["content"] == "asked through the first"


async def test_every_reply_reaches_the_gateway_that_asked(
        gateways: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    """Both gateways ask at once about the same sessions: a reply delivered to
    the wrong one would leave its asker waiting, or answer another text."""
    sessions = [await create(gateways[i % 2]) for i in range(4)]

    async def ask(i: int) -> tuple[str, httpx.Response]:
        content = f"query {i}"
        via = gateways[i % 2]
        return content, await via.post(f"/api/sessions/{sessions[i % 4]}/messages",
                                       json={"content": content})

    answers = await asyncio.gather(*(ask(i) for i in range(24)))
    for content, response in answers:
        assert response.status_code == 200, response.text
        assert response.json()["reply"].startswith(f"Echo: {content} (turn ")


async def test_a_session_deleted_through_one_gateway_is_unknown_to_the_others_controls(
        gateways: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    """The other gateway had seen the session, and took its word for it: it
    asked for a compaction of the deleted session, and told a stop or a retry
    there was nothing to do instead of 404."""
    deleting, other = gateways
    sid = await create(deleting)
    answer = await other.post(f"/api/sessions/{sid}/messages", json={"content": "hello"})
    assert answer.status_code == 200, answer.text
    assert (await deleting.delete(f"/api/sessions/{sid}")).status_code == 204
    for control in ("compact", "stop", "retry"):
        response = await other.post(f"/api/sessions/{sid}/{control}", json={})
        assert response.status_code == 404, (control, response.text)
        assert response.json()["error"]["code"] == "unknown_session"
