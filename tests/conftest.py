"""Shared fixtures: a real NATS server for the whole run, a connected client,
and the Ollama stand-in."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from hypothesis import settings
from nats.aio.client import Client as NATS

from tests.nats_server import NatsServer, backend, docker_nats, running_nats
from tests.stub_server import running_stub

# No time limit on a property's example: a stall of a busy machine would fail
# it as "unreliable timings", whatever the property.
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("contract", "tests/contract against a running system")
    group.addoption("--nats-url", default=None,
                    help="the running system's NATS (default: a system the tests start)")
    group.addoption("--gateway-url", default=None,
                    help="the running system's gateway, e.g. http://127.0.0.1:8080")


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """NATS_URL if given; testcontainers with NATS_TEST_BACKEND=docker; else the
    nats-server binary on a free port with a temporary store."""
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
    elif backend() == "docker":
        with docker_nats() as url:
            yield url
    else:
        with running_nats() as server:
            yield server.url


@pytest.fixture
def private_nats() -> Iterator[NatsServer]:
    """A server of the test's own, for tests that stop or restart it."""
    with running_nats() as server:
        yield server


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    client = await nats.connect(nats_url)
    yield client
    # close, not drain: a drain waits for unread messages of plain subscriptions.
    await client.close()


@pytest.fixture(scope="session")
def stub_url() -> Iterator[str]:
    with running_stub() as url:
        yield url
