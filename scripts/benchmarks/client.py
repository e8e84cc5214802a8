"""The driver's HTTP side: a lean client and the few calls the rows make to the
gateway and to the stand-in."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from scripts.benchmarks.harness import Env

# The gateway refuses a write without a JSON content type, body or not.
JSON_WRITES = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Answer:
    """An HTTP response, read whole."""

    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class Http:
    """The driver's HTTP client: aiohttp, whose CPU per request is a fraction of
    httpx's. The driver shares the machine's cores with what it measures, so
    every millisecond it spends is one the services do not get."""

    def __init__(self, base_url: str, connections: int) -> None:
        self._session = aiohttp.ClientSession(
            base_url=base_url, timeout=aiohttp.ClientTimeout(total=120.0),
            connector=aiohttp.TCPConnector(limit=connections))

    async def __aenter__(self) -> Http:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def get(self, path: str) -> Answer:
        async with self._session.get(path) as response:
            return Answer(response.status, await response.text())

    async def post(self, path: str, json: Any = None,
                   headers: dict[str, str] | None = None) -> Answer:
        async with self._session.post(path, json=json,
                                      headers={**JSON_WRITES, **(headers or {})}) as response:
            return Answer(response.status, await response.text())

    @contextlib.asynccontextmanager
    async def events(self, path: str, json: Any) -> AsyncIterator[AsyncIterator[tuple[str, str]]]:
        """A POST answered with server-sent events: (event, data) as each
        comes, until the block ends (which closes the response)."""
        async with self._session.post(path, json=json, headers={
                **JSON_WRITES, "Accept": "text/event-stream"}) as response:
            yield _events(response)


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    event = ""
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, line[6:]


def http_client(env: Env, connections: int = 32) -> Http:
    return Http(env.base_url, connections)


async def configure_stub(stub_url: str, **config: Any) -> None:
    async with Http(stub_url, 1) as client:
        answer = await client.post("/_stub/config", json=config)
    if answer.status_code != 200:
        raise RuntimeError(f"configuring the stand-in: HTTP {answer.status_code} {answer.text}")


async def new_session(http: Http, system: str = "") -> str:
    response = await http.post("/api/sessions", json={"system": system})
    if response.status_code != 201:
        raise RuntimeError(f"creating a session: HTTP {response.status_code} {response.text}")
    return str(response.json()["session_id"])


async def ask(http: Http, sid: str, content: str, key: str | None = None) -> Answer:
    """A question; under `key` (an Idempotency-Key) when one is given."""
    headers = {"Idempotency-Key": key} if key else None
    return await http.post(f"/api/sessions/{sid}/messages", json={"content": content},
                           headers=headers)


async def ask_ok(http: Http, sid: str, content: str) -> dict[str, Any]:
    response = await ask(http, sid, content)
    if response.status_code != 200:
        raise RuntimeError(f"query failed: HTTP {response.status_code} {response.text}")
    body: dict[str, Any] = response.json()
    return body


async def timed_ask(http: Http, sid: str, content: str
                    ) -> tuple[float, float, Answer]:
    """(start, seconds, response) of one query, start on the perf_counter clock."""
    started = time.perf_counter()
    response = await ask(http, sid, content)
    return started, time.perf_counter() - started, response
