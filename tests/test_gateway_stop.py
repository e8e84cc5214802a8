"""The gateway stopping (SIGTERM, Ctrl-C, `docker compose stop`) while pages
listen and callers wait: each is told in time, nobody's connection is just
cut at the services' bound on stopping, and no question is lost."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.shared.runner import SHUTDOWN_TIMEOUT_S
from tests.events import eventually, server_sent_events
from tests.stub_server import configure_stub, model_called, running_stub
from tests.system import System, running_system

MODEL = "stub-model"  # what sessions ask for in a test system (tests/system.py)
SSE = {"accept": "text/event-stream"}


@pytest.fixture
def stub() -> Iterator[str]:
    """A stand-in of the test's own: holding its model must not reach other tests."""
    with running_stub() as url:
        yield url


def stopped_cleanly(system: System) -> str:
    """The gateway's log, once it exited 0 within its bound without being cut short."""
    gateway = system["gateway"]
    assert gateway.proc is not None
    assert gateway.proc.wait(SHUTDOWN_TIMEOUT_S + 5) == 0
    log = gateway.log()
    assert "shutdown_timed_out" not in log, log[-3000:]
    assert "Exception in ASGI application" not in log, log[-3000:]
    return log


async def streamed_until_end(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                             ) -> list[tuple[str, dict[str, Any]]]:
    async with http.stream("POST", path, json=body, headers=SSE) as response:
        return [event async for event in server_sent_events(response)]


def test_an_open_event_stream_ends_cleanly_when_the_gateway_stops(
        nats_url: str, stub_url: str) -> None:
    with running_system(nats_url, stub_url, services=("gateway",)) as system, \
            system.client() as client, client.stream("GET", "/api/events") as events:
        lines = events.iter_lines()
        assert next(lines) == ": connected"
        system["gateway"].signal(signal.SIGTERM)
        # The whole body arrives: a cut connection would raise here instead.
        assert [line for line in lines if line] == []
        stopped_cleanly(system)


async def test_callers_waiting_when_the_gateway_stops_are_told_and_lose_nothing(
        nats_url: str, stub: str) -> None:
    # A grace longer than uvicorn's own 2 s for the last responses: the callers
    # must be told at its end, not cancelled by uvicorn before it.
    with running_system(nats_url, stub, {"STOP_GRACE_S": "3"}) as system:
        async with system.http(timeout=60) as http:
            sids = [(await http.post("/api/sessions", json={})).json()["session_id"]
                    for _ in range(2)]
            await configure_stub(stub, held_models=[MODEL])
            waiting = asyncio.create_task(
                http.post(f"/api/sessions/{sids[0]}/messages", json={"content": "plain"}))
            streaming = asyncio.create_task(streamed_until_end(
                http, f"/api/sessions/{sids[1]}/messages", {"content": "streamed"}))
            await model_called(stub, 2)
            system["gateway"].signal(signal.SIGTERM)
            plain, streamed = await waiting, await streaming
        stopped_cleanly(system)
        assert plain.status_code == 503
        assert plain.json()["error"]["code"] == "gateway_stopping"
        assert streamed[-1][0] == "error"
        assert streamed[-1][1]["error"]["code"] == "gateway_stopping"
        await configure_stub(stub, held_models=[])
        system["gateway"].start()
        async with system.http(timeout=60) as http:
            for sid, question in zip(sids, ("plain", "streamed"), strict=True):
                async def answered(sid: str = sid) -> bool:
                    session = (await http.get(f"/api/sessions/{sid}")).json()
                    return len(session["messages"]) == 2
                await eventually(answered, f"{question} answered into the history")
                messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
                assert messages[0]["content"] == question


async def test_an_answer_that_comes_within_the_grace_reaches_its_caller(
        nats_url: str, stub: str) -> None:
    with running_system(nats_url, stub, {"STOP_GRACE_S": "6"}) as system:
        async with system.http(timeout=60) as http:
            sid = (await http.post("/api/sessions", json={})).json()["session_id"]
            await configure_stub(stub, held_models=[MODEL])
            waiting = asyncio.create_task(
                http.post(f"/api/sessions/{sid}/messages", json={"content": "just in time"}))
            await model_called(stub, 1)
            gateway = system["gateway"]
            gateway.signal(signal.SIGTERM)
            await eventually(lambda: "service_stopping" in gateway.log(), "the gateway stopping")
            await configure_stub(stub, held_models=[])
            answer = await waiting
        assert answer.status_code == 200, answer.text
        assert answer.json()["reply"] == "Echo: just in time (turn 1)"
        stopped_cleanly(system)
