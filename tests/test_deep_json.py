"""JSON nested too deep to parse, on real processes: Python's parser raises
RecursionError (not a ValueError) for it, and it must still be a clear 400
on every endpoint and a reported, harmless message on every subject."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas import subjects
from services.shared.bus import round_trip
from tests.nats_server import NatsServer, running_nats
from tests.system import System, running_system

DEPTH = 100_000
DEEP = b'{"content": ' + b"[" * DEPTH + b"]" * DEPTH + b"}"


@pytest.fixture(scope="module")
def own_nats() -> Iterator[NatsServer]:
    """A server of this module's own, whose sessions others do not see."""
    with running_nats() as server:
        yield server


@pytest.fixture(scope="module")
def system(own_nats: NatsServer, stub_url: str) -> Iterator[System]:
    with running_system(own_nats.url, stub_url,
                        services=("generator", "decider", "gateway", "tools")) as running:
        yield running


@pytest.fixture
async def http(system: System) -> AsyncIterator[httpx.AsyncClient]:
    async with system.http(timeout=30) as client:
        yield client


@pytest.fixture
async def nc(own_nats: NatsServer) -> AsyncIterator[NATS]:
    client = await nats.connect(own_nats.url)
    yield client
    await client.close()


async def create(http: httpx.AsyncClient) -> str:
    return str((await http.post("/api/sessions", json={})).json()["session_id"])


def alive(system: System) -> None:
    for name, process in system.processes.items():
        assert process.proc is not None and process.proc.poll() is None, name


async def test_a_body_nested_too_deep_is_invalid_json_on_every_endpoint(
        system: System, http: httpx.AsyncClient) -> None:
    sid = await create(http)
    posts = [("/api/sessions", {}), (f"/api/sessions/{sid}/messages", {}),
             (f"/api/sessions/{sid}/messages", {"Accept": "text/event-stream"}),
             (f"/api/sessions/{sid}/compact", {})]
    for path, headers in posts:
        response = await http.post(path, content=DEEP, headers=headers)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_json", path
    answer = await http.post(f"/api/sessions/{sid}/messages", json={"content": "still here?"})
    assert answer.json()["reply"] == "Echo: still here? (turn 1)"
    alive(system)


async def test_a_state_nested_too_deep_does_not_break_reading_the_session(
        system: System, http: httpx.AsyncClient, nc: NATS) -> None:
    """Anyone may publish a session's state; the last one is what the session
    page shows, and one that cannot be parsed reads as unknown."""
    sid = await create(http)
    await nc.jetstream().publish(subjects.state(sid), DEEP)
    session = await http.get(f"/api/sessions/{sid}")
    assert session.status_code == 200, session.text
    assert session.json()["state"] == "unknown"


async def test_messages_nested_too_deep_are_reported_on_every_subject(
        system: System, http: httpx.AsyncClient, nc: NATS) -> None:
    sid = await create(http)
    errors = await nc.subscribe(subjects.ERROR_SUBJECT)
    js = nc.jetstream()
    for subject in (subjects.query(sid), subjects.COMPACTION_REQUEST,
                    subjects.RESPONSE_GENERATION):
        await js.publish(subject, DEEP)
    for subject in (subjects.COMPACTION_RESULT, subjects.reply(sid), subjects.token(sid)):
        await nc.publish(subject, DEEP)
    expected = {subjects.query(sid), subjects.COMPACTION_REQUEST, subjects.RESPONSE_GENERATION,
                subjects.COMPACTION_RESULT, subjects.reply(sid), subjects.token(sid)}
    seen: set[str] = set()
    while not expected <= seen:
        report = json.loads((await errors.next_msg(timeout=15)).data)["payload"]
        assert report["code"] == "invalid_message"
        seen.add(report["subject"])
    tool_reply = await nc.request(subjects.tool("calculate"), DEEP, timeout=10)
    assert json.loads(tool_reply.data)["payload"]["code"] == "invalid_message"
    answer = await http.post(f"/api/sessions/{sid}/messages", json={"content": "and now?"})
    assert answer.json()["reply"] == "Echo: and now? (turn 1)"
    alive(system)


async def test_a_tool_list_nested_too_deep_leaves_the_turn_answered(
        private_nats: NatsServer, stub_url: str) -> None:
    """The generator asks `tool.list` for its first turn (no tools service runs
    here, and a generator of its own has cached no answer yet): an answer it
    cannot parse means no tools, not a crashed turn."""
    nc = await nats.connect(private_nats.url)

    async def deep_listing(msg: Msg) -> None:
        await msg.respond(b"[" * DEPTH + b"]" * DEPTH)

    await nc.subscribe(subjects.TOOL_LIST, cb=deep_listing)
    await round_trip(nc)
    try:
        with running_system(private_nats.url, stub_url,
                            services=("generator", "gateway")) as system:
            async with system.http(timeout=30) as http:
                sid = await create(http)
                answer = await http.post(f"/api/sessions/{sid}/messages",
                                         json={"content": "tools?"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["reply"] == "Echo: tools? (turn 1)"
            alive(system)
    finally:
        await nc.close()
