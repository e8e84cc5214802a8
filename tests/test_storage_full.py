"""NATS out of room (JetStream's limits reached, its disk or memory full):
each write refused is told as 507 `storage_full`, as JSON or as a stream's
last event, never as a 500 or a crash tried again; what was stored stays whole."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.events import server_sent_events
from tests.nats_server import NatsServer, running_nats
from tests.system import running_system

# An account whose JetStream may keep 1 MB on disk: some eighty turns fill it.
SMALL_ACCOUNT = ("accounts { A: { jetstream: { max_file: 1MB, max_mem: 32MB },"
                 " users: [{user: a, password: a}] } }\nno_auth_user: a\n")
FILLER = "x" * 6000
SSE = {"accept": "text/event-stream"}


@pytest.fixture
def small_nats() -> Iterator[NatsServer]:
    with running_nats(SMALL_ACCOUNT) as server:
        yield server


async def filled(http: httpx.AsyncClient) -> dict[str, int]:
    """Sessions of three turns each until the store refuses; each answered
    session with its number of answered turns."""
    answered: dict[str, int] = {}
    for turn in range(1000):
        if turn % 3 == 0:
            created = await http.post("/api/sessions", json={})
            if created.status_code != 201:
                assert_refused(created)
                return answered
            sid = created.json()["session_id"]
            answered[sid] = 0
        asked = await http.post(f"/api/sessions/{sid}/messages", json={"content": FILLER})
        if asked.status_code != 200:
            assert_refused(asked)
            return answered
        answered[sid] += 1
    raise AssertionError("1,000 turns and the store is not full")


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 507, response.text
    assert response.json()["error"]["code"] == "storage_full"


async def streamed(http: httpx.AsyncClient, sid: str, content: str) -> list[Any]:
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": content},
                           headers=SSE) as response:
        return [event async for event in server_sent_events(response)]


async def test_a_full_store_is_told_as_storage_full_and_keeps_what_it_held(
        small_nats: NatsServer, stub_url: str) -> None:
    # A window an answer of 200,000 characters fits in: an answer may take
    # only what its prompt leaves of the window.
    with running_system(small_nats.url, stub_url, {"NUM_CTX": "131072"}) as system:
        async with system.http(timeout=60) as http:
            answered = await filled(http)
            freed, *kept = [sid for sid, turns in answered.items() if turns]
            assert (await http.delete(f"/api/sessions/{freed}")).status_code == 204
            # Room for a question now, not for an answer of 200,000 characters.
            too_long = await http.post(f"/api/sessions/{kept[0]}/messages",
                                       json={"content": "at length !long 200000"})
            assert_refused(too_long)
            assert "the answer was not kept" in too_long.json()["error"]["message"]
            # Nor for a question of 300,000: refused before it reaches a generator.
            too_large = await http.post(f"/api/sessions/{kept[0]}/messages",
                                        json={"content": "y" * 300_000})
            assert_refused(too_large)
            assert "nothing was stored" in too_large.json()["error"]["message"]
            events = await streamed(http, kept[0], "z" * 300_000)
            assert events[-1][0] == "error"
            assert events[-1][1]["error"]["code"] == "storage_full"
            for sid in kept:
                messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
                assert len(messages) == 2 * answered[sid], sid
    for name in ("gateway", "generator"):
        log = system[name].log()
        assert "query_crashed" not in log and "request_failed\"" not in log, log[-3000:]
