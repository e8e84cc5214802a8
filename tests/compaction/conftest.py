"""The system the compaction tests run on (`tests.compaction.rig`), started
afresh for each test and stopped after it, even when the test fails."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest

from tests.compaction.rig import SMALL_WINDOW, compaction_stub
from tests.nats_server import NatsServer
from tests.system import System


@pytest.fixture
def stub() -> Iterator[str]:
    with compaction_stub() as url:
        yield url


@pytest.fixture
async def start(private_nats: NatsServer, stub: str
                ) -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    """Start the system with settings of the test's own and hand back an HTTP
    client on it; everything is stopped after, even when the test fails."""
    systems: list[System] = []
    clients: list[httpx.AsyncClient] = []

    def starter(services: tuple[str, ...] = ("generator", "decider", "gateway"),
                **env: str) -> httpx.AsyncClient:
        systems.append(System(private_nats.url, stub, {**SMALL_WINDOW, **env},
                              services=services).start())
        clients.append(systems[-1].http(timeout=60))
        return clients[-1]

    yield starter
    for client in clients:
        await client.aclose()
    for system in systems:
        system.stop()
