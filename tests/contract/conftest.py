"""The system the contract tests check: the one named by `--nats-url` and
`--gateway-url`, or else one they start (the four services against the
test NATS and the Ollama stand-in)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.system import running_system


@dataclass(frozen=True)
class Target:
    nats_url: str
    gateway_url: str


@pytest.fixture(scope="package")
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    nats_url = request.config.getoption("--nats-url")
    gateway_url = request.config.getoption("--gateway-url")
    if nats_url and gateway_url:
        yield Target(nats_url, gateway_url.rstrip("/"))
        return
    if nats_url or gateway_url:
        pytest.fail("give both --nats-url and --gateway-url, or neither")
    started_nats = request.getfixturevalue("nats_url")
    stub = request.getfixturevalue("stub_url")
    services = ("tools", "generator", "decider", "gateway")
    with running_system(started_nats, stub, services=services) as system:
        yield Target(started_nats, system.base_url)
