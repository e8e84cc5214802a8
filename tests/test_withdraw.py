"""A message stopped while it waits for its turn is withdrawn: never sent to
the model, nothing of it stored, and its caller told so. Every generator
remembers the stops it heard; one that was not listening then finds the
withdrawal the gateway kept as the query's error reply."""

from __future__ import annotations

import asyncio

import nats

from schemas import subjects
from schemas.messages import Reply, StopAccepted, StopRequest
from services.generator.settings import GeneratorSettings
from services.shared.bus import Bus, decode
from services.shared.history_store import HistoryStore
from services.shared.jetstream import ensure_layout
from services.shared.query_errors import WITHDRAWN_TEXT, QueryErrors
from tests.events import eventually
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, model_called, running_stub, stub_stats
from tests.system import System
from tests.test_generator_order import SID, ask, generator_on


async def test_a_generator_holding_a_query_withdraws_it_when_asked_to_stop_it(
        private_nats: NatsServer) -> None:
    """No gateway here: the generator's own word, and its keeping to it. The
    withdrawn query's turn never calls the model, not even ahead of its lock."""
    with running_stub() as stub:
        await configure_stub(stub, held_models=["stub-model"])
        settings = GeneratorSettings(ollama_host=stub, model="stub-model")
        async with generator_on(private_nats.url, settings) as (bus, replies):
            first = await ask(bus, "one")
            await model_called(stub)
            second = await ask(bus, "two")
            said: list[str] = []

            async def holding_says_withdrawing() -> bool:
                said.append(await _stop(bus, second))
                return said[-1] == "withdrawing"
            # Until it holds the query: a stop before is kept all the same, unanswered.
            await eventually(holding_says_withdrawing, "the second query held")
            assert await _stop(bus, first) == "stopping"
            await replies.wait_for(second)
            view = await HistoryStore(bus.js).read(SID)
        calls = (await stub_stats(stub))["requests"]
    [withdrawn] = [r for r in replies.got if r.query_id == second]
    assert withdrawn.error_code == "withdrawn"
    [stopped] = [r for r in replies.got if r.query_id == first]
    assert stopped.stopped
    assert [m.query_id for m in view.conversation.messages if m.role == "user"] == [first]
    assert calls == 1


async def _stop(bus: Bus, query_id: str) -> str:
    """The status the generator answers a stop of the query with; "" for none."""
    try:
        msg = await bus.request(subjects.stop(SID), StopRequest(
            session_id=SID, query_id=query_id), timeout_s=0.5, session_id=SID)
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, TimeoutError):
        return ""
    return decode(msg.data, StopAccepted, msg.subject).payload.status


async def test_a_message_stopped_while_no_generator_runs_is_taken_out_of_the_queue(
        private_nats: NatsServer) -> None:
    """None heard the stop: the gateway takes the message out of the queue."""
    key = {"Idempotency-Key": "waits-for-a-generator"}
    with running_stub() as stub:
        system = System(private_nats.url, stub, services=("gateway",)).start()
        try:
            async with system.http() as http:
                sid = (await http.post("/api/sessions", json={})).json()["session_id"]
                sent = asyncio.create_task(http.post(
                    f"/api/sessions/{sid}/messages", json={"content": "never mind"},
                    headers=key))
                await eventually(lambda: _queued(private_nats.url), "the message queued")
                stop = await http.post(f"/api/sessions/{sid}/stop", headers=key)
                assert stop.status_code == 202, stop.text
                assert stop.json()["status"] == "withdrawn"
                told = await sent
                assert told.status_code == 409 and told.json()["error"]["code"] == "withdrawn"
                assert not await _queued(private_nats.url)  # out of the queue for good
                system.add("generator", "services.generator").start()
                nxt = await http.post(f"/api/sessions/{sid}/messages", json={"content": "next"})
                assert nxt.status_code == 200, nxt.text
                assert nxt.json()["reply"] == "Echo: next (turn 1)"
                messages = (await http.get(f"/api/sessions/{sid}")).json()["messages"]
        finally:
            system.stop()
    assert [m["content"] for m in messages if m["role"] == "user"] == ["next"]


async def test_a_generator_that_may_have_missed_the_stop_reads_the_withdrawal_kept(
        private_nats: NatsServer, stub_url: str) -> None:
    """The message was still queued when it was withdrawn (its generator held
    it without hearing the stop, having just begun to listen): the error
    reply the gateway kept for it says so."""
    settings = GeneratorSettings(ollama_host=stub_url, model="stub-model")
    nc = await nats.connect(private_nats.url)
    try:
        bus = Bus(nc, "gateway")
        await ensure_layout(bus.js)
        withdrawn = await ask(bus, "never mind")
        await QueryErrors(bus.js).keep(Reply(session_id=SID, query_id=withdrawn,
                                             error=WITHDRAWN_TEXT, error_code="withdrawn"),
                                       "never mind")
        later = await ask(bus, "next")
    finally:
        await nc.close()
    async with generator_on(private_nats.url, settings) as (bus, replies):
        await replies.wait_for(later)
        view = await HistoryStore(bus.js).read(SID)
    assert [r.error_code for r in replies.got if r.query_id == withdrawn] == ["withdrawn"]
    assert [m.content for m in view.conversation.messages if m.role == "user"] == ["next"]


async def _queued(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(subjects.QUERIES_STREAM)).state.messages > 0
    finally:
        await nc.close()
