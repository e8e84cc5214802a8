"""A generator and a gateway on a stand-in that writes 5 ms a token and
knows one model (`stub-model`): an answer to `LONG` is under way for as long
as a test needs it, to be stopped, retried or sent again.

A test module takes the fixtures by naming them in its own namespace
(`stub, system, http = slow_answers.stub, ...`): each module gets a system
of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.stub_server import running_stub
from tests.system import System, running_system

# Some 10 000 tokens at 5 ms each: never ends by itself in a test.
LONG = "tell me everything !long 40000"
SSE = {"accept": "text/event-stream"}


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    with running_stub("--ms-per-token", "5", "--models", "stub-model") as url:
        yield url


@pytest.fixture(scope="module")
def system(nats_url: str, stub: str) -> Iterator[System]:
    with running_system(nats_url, stub, services=("generator", "gateway")) as running:
        yield running


@pytest.fixture
async def http(system: System) -> AsyncIterator[httpx.AsyncClient]:
    async with system.http(timeout=60) as client:
        yield client


async def create(http: httpx.AsyncClient) -> str:
    return str((await http.post("/api/sessions", json={})).json()["session_id"])
