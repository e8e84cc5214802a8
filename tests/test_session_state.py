"""The session's state is the session's, whichever generator publishes: a
background compaction on one generator is still the session's state while
another answers its turns. Real processes, real nats-server, the stand-in."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest

from schemas import subjects
from services.generator.service import QUERY_CONSUMER
from tests.events import Watcher, eventually, watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, running_stub
from tests.system import System

SUMMARISER = "summariser"
ENV = {
    "COMPACTION_MODEL": SUMMARISER,
    "COMPACTION_THRESHOLD": "0",  # manual compaction only
    "COMPACTION_TAIL_TURNS": "1",
    # The compacting generator is frozen for a while below: its request must not
    # be handed to the other meanwhile.
    "QUERY_ACK_WAIT_S": "60",
}
EVENTS = (subjects.COMPACTION_EVENT, subjects.COMPACTION_RESULT, f"{subjects.STATE_PREFIX}.*")


@pytest.fixture
def stub() -> Iterator[str]:
    with running_stub() as url:
        yield url


@pytest.fixture
def system(private_nats: NatsServer, stub: str) -> Iterator[System]:
    system = System(private_nats.url, stub, ENV, services=("gateway",))
    try:
        yield system.start()
    finally:
        system.stop()


async def no_pull_request_standing(nats_url: str, stream: str, durable: str,
                                   timeout_s: float = 20.0) -> None:
    """Until no generator has a pull request standing on the consumer: a frozen
    one's end at their expiry, so nothing more can be delivered to it."""
    nc = await nats.connect(nats_url)
    try:
        for _ in range(int(timeout_s / 0.05)):
            if not (await nc.jetstream().consumer_info(stream, durable)).num_waiting:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"pull requests still standing on {durable} after {timeout_s} s")
    finally:
        await nc.close()


def of_session(watcher: Watcher, sid: str, message_type: str) -> list[dict[str, Any]]:
    return [p for p in watcher.payloads(message_type) if p["session_id"] == sid]


async def state_of(http: httpx.AsyncClient, sid: str) -> tuple[str, str]:
    body = (await http.get(f"/api/sessions/{sid}")).json()
    return body["state"], body["phase"]


async def turns_to_fold(http: httpx.AsyncClient, stub: str) -> str:
    """A new session with three long turns; a summary of them stays under way
    until the test lets it go."""
    sid = str((await http.post("/api/sessions", json={})).json()["session_id"])
    for n in range(3):
        answer = await http.post(f"/api/sessions/{sid}/messages",
                                 json={"content": f"question {n} !long 100"})
        assert answer.status_code == 200, answer.text
    await configure_stub(stub, held_models=[SUMMARISER])
    return sid


async def test_a_compaction_on_one_generator_stays_the_state_while_another_answers(
    private_nats: NatsServer, stub: str, system: System
) -> None:
    compacting = system.add("generator-a", "services.generator", {"GENERATOR_ID": "gen-a"})
    compacting.start()
    async with system.http(timeout=60) as http:
        sid = await turns_to_fold(http, stub)
        async with watching(private_nats.url, *EVENTS) as watcher:
            await http.post(f"/api/sessions/{sid}/compact")
            await watcher.wait_until(lambda: bool(of_session(watcher, sid, "compaction.event")))
            assert await state_of(http, sid) == ("compacting", "idle")

            # Generator A, frozen mid-compaction, can take no query: once its pull
            # requests have ended, generator B, started now, answers the next turn.
            compacting.signal(signal.SIGSTOP)
            await no_pull_request_standing(private_nats.url, subjects.QUERIES_STREAM,
                                           QUERY_CONSUMER)
            system.add("generator-b", "services.generator", {"GENERATOR_ID": "gen-b"}).start()
            answer = await http.post(f"/api/sessions/{sid}/messages",
                                     json={"content": "meanwhile"})
            assert answer.status_code == 200, answer.text
            await watcher.wait_until(lambda: any(
                p["action"] == "reset" for p in of_session(watcher, sid, "generator.state")))
            published = of_session(watcher, sid, "generator.state")
            assert published[-1]["generator_id"] == "gen-b"  # B answered, and had
            assert published[-1]["to_state"] == "idle"  # the last word on the session...
            # ... and still the session is compacting.
            state, _ = await state_of(http, sid)
            assert state == "compacting"

            compacting.signal(signal.SIGCONT)
            await configure_stub(stub, held_models=[])
            await watcher.wait_until(lambda: bool(of_session(watcher, sid, "compaction.result")))
        result = of_session(watcher, sid, "compaction.result")[0]
        assert result["status"] == "completed", result["error"]
        assert await state_of(http, sid) == ("idle", "idle")


async def test_a_session_reads_as_not_compacting_when_the_record_of_compactions_is_gone(
    private_nats: NatsServer, system: System
) -> None:
    """The bucket lives in memory: a NATS restart loses it until a service makes
    it again. Meanwhile nothing is known to run, and the read still answers."""
    async with system.http(timeout=30) as http:
        sid = (await http.post("/api/sessions", json={})).json()["session_id"]
        assert await state_of(http, sid) == ("idle", "idle")  # the bucket, found
        nc = await nats.connect(private_nats.url)
        try:
            await nc.jetstream().delete_key_value(subjects.COMPACTIONS_RUNNING_BUCKET)
        finally:
            await nc.close()
        assert await state_of(http, sid) == ("idle", "idle")


async def test_a_compaction_running_across_a_nats_restart_is_still_the_state(
    private_nats: NatsServer, stub: str, system: System
) -> None:
    """The record of compactions running lives in memory: after a restart of
    NATS the session read idle until the compaction ended."""
    system.add("generator", "services.generator").start()
    async with system.http(timeout=60) as http:
        sid = await turns_to_fold(http, stub)
        async with watching(private_nats.url, *EVENTS) as watcher:
            await http.post(f"/api/sessions/{sid}/compact")
            await watcher.wait_until(lambda: bool(of_session(watcher, sid, "compaction.event")))
        private_nats.restart()

        async def compacting() -> bool:
            response = await http.get(f"/api/sessions/{sid}")
            return response.status_code == 200 and response.json()["state"] == "compacting"
        await eventually(compacting, "the compaction recorded again", timeout_s=30)
        await configure_stub(stub, held_models=[])

        async def idle() -> bool:
            return await state_of(http, sid) == ("idle", "idle")
        await eventually(idle, "the compaction's end recorded", timeout_s=30)
