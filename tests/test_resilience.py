"""Services outlive NATS going away and coming back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from schemas import subjects
from schemas.messages import Query, Reply
from services.shared.bus import Bus, decode
from services.shared.jetstream import ensure_layout
from services.shared.runner import SHUTDOWN_TIMEOUT_S
from tests.events import eventually, server_sent_events, until, watching
from tests.nats_server import NatsServer
from tests.processes import ServiceProcess
from tests.stub_server import configure_stub, model_called, running_stub
from tests.system import SERVICE_MODULES, System, ask, new_session, running_system
from tests.tcp_relay import Relay, relay_to


def wait_for_status(client: httpx.Client, path: str, status: int, timeout_s: float) -> None:
    def answered() -> bool:
        try:
            return client.get(path).status_code == status
        except httpx.TransportError:
            return False

    until(answered, f"{path} answered {status}", timeout_s)


def test_services_reconnect_after_nats_restarts(private_nats: NatsServer, stub_url: str) -> None:
    with running_system(private_nats.url, stub_url) as system, system.client() as client:
        sid = new_session(client)
        assert ask(client, sid, "before").status_code == 200
        private_nats.stop()
        wait_for_status(client, "/healthz", 503, 10)
        private_nats.start()
        wait_for_status(client, "/healthz", 200, 15)
        answer = ask(client, sid, "after")
        assert answer.status_code == 200, answer.text
        assert answer.json()["reply"] == "Echo: after (turn 2)"
        for name in ("generator", "decider", "gateway"):
            assert system[name].proc is not None and system[name].proc.poll() is None


def test_sigterm_while_nats_is_away_exits_cleanly(private_nats: NatsServer,
                                                  stub_url: str) -> None:
    every_service = ("generator", "decider", "gateway", "tools")
    with running_system(private_nats.url, stub_url, services=every_service) as system:
        private_nats.stop()
        for name in every_service:
            system[name].wait_for("nats_disconnected", 10)
        for name in every_service:
            # Bounded: the runner gives up on NATS after SHUTDOWN_TIMEOUT_S.
            code = system[name].stop(timeout_s=SHUTDOWN_TIMEOUT_S + 5)
            log = system[name].log()
            assert code == 0, f"{name} exited with {code}:\n{log[-3000:]}"
            assert "Traceback" not in log, log[-3000:]
            assert log.count("nats_unreachable_at_shutdown") == 1, log[-3000:]
            assert "service_stopped" in log


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_each_stop_signal_drains_the_service(nats_url: str, stub_url: str,
                                             stop_signal: signal.Signals) -> None:
    """SIGHUP is what a service of `make run` gets when its terminal closes."""
    with running_system(nats_url, stub_url, services=("generator",)) as system:
        generator = system["generator"]
        generator.signal(stop_signal)
        assert generator.proc is not None and generator.proc.wait(SHUTDOWN_TIMEOUT_S + 5) == 0
        assert "service_stopped" in generator.log()


def no_uncaught_traceback(log: str) -> bool:
    """A traceback printed by a dying process starts a line; one inside a
    JSON log record (an error logged with its exception) does not."""
    return not any(line.startswith("Traceback") for line in log.splitlines())


async def test_sigterm_while_nats_is_away_mid_turn_exits_within_the_bound(
        private_nats: NatsServer) -> None:
    with running_stub("--model-latency", "slow=1500") as stub, running_system(
            private_nats.url, stub, services=("generator", "gateway")) as system:
        async with system.http(timeout=30) as http:
            sid = (await http.post("/api/sessions", json={"model": "slow"})).json()["session_id"]
            asking = asyncio.create_task(
                http.post(f"/api/sessions/{sid}/messages", json={"content": "hello"}))
            await model_called(stub)
            private_nats.stop()  # while the model answers
            generator = system["generator"]
            generator.wait_for("nats_disconnected", 10)
            code = generator.stop(timeout_s=SHUTDOWN_TIMEOUT_S + 5)
            asking.cancel()
            log = generator.log()
            assert code == 0, log[-3000:]
            assert no_uncaught_traceback(log), log[-3000:]
            assert log.count("nats_unreachable_at_shutdown") == 1, log[-3000:]


# NATS back, with its store or without it: everything answers again within
# this long of the server being up, with no service restarted.
RECOVERY_S = 5.0
Send = Callable[[float], Awaitable[httpx.Response]]


async def answered_within(deadline: float, send: Send, status: int,
                          retry_on: Callable[[httpx.Response], bool] = lambda r: True
                          ) -> httpx.Response:
    """`send` (given the time left) until it answers `status`, while the
    answer is one worth trying again after; fails at the deadline."""
    last = "nothing"
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"not answered {status} within {RECOVERY_S} s; last: {last}"
        try:
            response = await send(left)
        except httpx.TransportError as err:
            last = repr(err)
        else:
            if response.status_code == status:
                return response
            last = f"{response.status_code} {response.text[:300]}"
            assert retry_on(response), last
        await asyncio.sleep(0.05)


def get(http: httpx.AsyncClient, path: str) -> Send:
    return lambda left: http.get(path, timeout=left)


def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Send:
    return lambda left: http.post(path, json=body, timeout=left)


def nothing_done(response: httpx.Response) -> bool:
    """A write the gateway refused because NATS is not ready: safe to send again."""
    return response.status_code == 503


class LiveFeed:
    """The page's live feed (`/api/events`), read in the background."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._changed = asyncio.Event()
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LiveFeed:
        self._task = asyncio.create_task(self._read())
        async with asyncio.timeout(10):
            await self._connected.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _read(self) -> None:
        async with self._http.stream("GET", "/api/events", timeout=None) as response:
            name = ""
            async for line in response.aiter_lines():
                if line == ": connected":
                    self._connected.set()
                elif line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    self.events.append((name, json.loads(line[6:])))
                    self._changed.set()

    async def wait_for(self, predicate: Callable[[str, dict[str, Any]], bool],
                       timeout_s: float = 20.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while True:
                for name, data in self.events:
                    if predicate(name, data):
                        return data
                self._changed.clear()
                await self._changed.wait()


def of_session(sid: str, message_type: str) -> Callable[[str, dict[str, Any]], bool]:
    return lambda name, data: name == message_type and data.get("session_id") == sid


async def a_fresh_feed_connects(http: httpx.AsyncClient, deadline: float) -> None:
    async with asyncio.timeout(deadline - time.monotonic()), http.stream(
            "GET", "/api/events", timeout=None) as response:
        assert response.status_code == 200
        assert await anext(response.aiter_lines()) == ": connected"


async def test_nats_restarted_on_its_store_leaves_every_endpoint_answering(
        private_nats: NatsServer, stub_url: str) -> None:
    env = {"COMPACTION_TAIL_TURNS": "1", "COMPACTION_THRESHOLD": "0"}
    with running_system(private_nats.url, stub_url, env) as system:
        async with system.http(timeout=30) as http:
            sid = (await http.post("/api/sessions", json={})).json()["session_id"]
            for content in ("one !long 100", "two !long 100"):
                answer = await http.post(f"/api/sessions/{sid}/messages",
                                         json={"content": content})
                assert answer.status_code == 200, answer.text
            before = (await http.get(f"/api/sessions/{sid}")).json()
            async with LiveFeed(http) as feed:
                private_nats.stop()
                system["gateway"].wait_for("nats_disconnected", 10)
                private_nats.start()
                deadline = time.monotonic() + RECOVERY_S

                await answered_within(deadline, get(http, "/healthz"), 200)
                session = (await answered_within(
                    deadline, get(http, f"/api/sessions/{sid}"), 200)).json()
                assert session["messages"] == before["messages"]  # history intact
                assert session["state"] == "idle"
                listed = (await answered_within(deadline, get(http, "/api/sessions"), 200))
                assert [s["session_id"] for s in listed.json()["sessions"]] == [sid]
                await answered_within(deadline, get(http, "/"), 200)
                await a_fresh_feed_connects(http, deadline)
                answer = await answered_within(deadline, post(
                    http, f"/api/sessions/{sid}/messages", {"content": "three"}), 200,
                    nothing_done)
                assert answer.json()["reply"] == "Echo: three (turn 3)"
                await answered_within(
                    deadline, post(http, f"/api/sessions/{sid}/compact", {}), 202, nothing_done)

                # The feed the page held open all along sees the turn and the compaction.
                await feed.wait_for(of_session(sid, "generator.state"))
                result = await feed.wait_for(of_session(sid, "compaction.result"))
            assert result["payload"]["status"] == "completed", result["payload"]
            assert (await http.get(f"/api/sessions/{sid}")).json()["compactions"] == 1


async def test_nats_restarted_without_its_store_works_again(
        private_nats: NatsServer, stub_url: str) -> None:
    # Automatic compaction off until a live setting turns it on, after the
    # restart: that reaches the decider only through a watch made anew.
    env = {"NUM_CTX": "2048", "COMPACTION_TAIL_TURNS": "1", "COMPACTION_COOLDOWN_S": "1",
           "COMPACTION_THRESHOLD": "0"}
    with running_system(private_nats.url, stub_url, env) as system:
        async with system.http(timeout=30) as http:
            lost = (await http.post("/api/sessions", json={})).json()["session_id"]
            assert (await http.post(f"/api/sessions/{lost}/messages",
                                    json={"content": "before"})).status_code == 200
            async with LiveFeed(http) as feed:
                private_nats.stop()
                system["gateway"].wait_for("nats_disconnected", 10)
                private_nats.lose_store()
                private_nats.start()
                deadline = time.monotonic() + RECOVERY_S

                created = await answered_within(
                    deadline, post(http, "/api/sessions", {}), 201, nothing_done)
                sid = created.json()["session_id"]
                session = (await answered_within(
                    deadline, get(http, f"/api/sessions/{sid}"), 200)).json()
                assert session["messages"] == [] and session["state"] == "idle"
                await answered_within(deadline, get(http, f"/api/sessions/{lost}"), 404)
                await answered_within(deadline, post(
                    http, f"/api/sessions/{lost}/messages", {"content": "again"}), 404,
                    nothing_done)
                answer = await answered_within(deadline, post(
                    http, f"/api/sessions/{sid}/messages", {"content": "first"}), 200,
                    nothing_done)
                assert answer.json()["reply"] == "Echo: first (turn 1)"
                await a_fresh_feed_connects(http, deadline)
                await turn_compaction_on(private_nats.url, deadline)

                # Turns until the decider asks for a compaction, and it is done.
                for turn in range(2, 12):
                    answer = await http.post(f"/api/sessions/{sid}/messages",
                                             json={"content": f"question {turn} !long 400"})
                    assert answer.status_code == 200, answer.text
                    if any(of_session(sid, "compaction.request")(*e) for e in feed.events):
                        break
                result = await feed.wait_for(of_session(sid, "compaction.result"))
            request = next(data for name, data in feed.events
                           if of_session(sid, "compaction.request")(name, data))
            assert request["payload"]["auto"] is True
            assert result["payload"]["status"] == "completed", result["payload"]
            assert (await http.get(f"/api/sessions/{sid}")).json()["compactions"] == 1


async def test_a_query_lost_with_the_store_is_said_lost_at_once(
        private_nats: NatsServer) -> None:
    """The store went while the model answered: nobody was left to reply, and
    the caller waited REPLY_TIMEOUT_S to be told its query stayed queued."""
    env = {"REPLY_TIMEOUT_S": "120"}
    with running_stub() as stub, running_system(private_nats.url, stub, env,
                                                services=("generator", "gateway")) as system:
        async with system.http(timeout=150) as http:
            sid = (await http.post("/api/sessions", json={})).json()["session_id"]
            await configure_stub(stub, held_models=["stub-model"])
            asked = asyncio.create_task(http.post(
                f"/api/sessions/{sid}/messages", json={"content": "lost?"},
                headers={"Idempotency-Key": "lost-with-the-store"}))
            await model_called(stub)
            private_nats.stop()
            system["gateway"].wait_for("nats_disconnected", 10)
            private_nats.lose_store()
            private_nats.start()
            answer = await asked
            await configure_stub(stub, held_models=[])
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "nats_unavailable"
    assert "without this query" in answer.json()["error"]["message"]


async def turn_compaction_on(nats_url: str, deadline: float) -> None:
    """Put the threshold in the live settings, once a service has made the
    bucket again."""
    nc = await nats.connect(nats_url)
    try:
        while True:
            try:
                kv = await nc.jetstream().key_value(subjects.CONFIG_BUCKET)
                break
            except NotFoundError:
                assert time.monotonic() < deadline, "no service made the config bucket again"
                await asyncio.sleep(0.05)
        await kv.put("compaction_threshold", b"0.2")
    finally:
        await nc.close()


async def test_a_missing_stream_reads_as_nothing_yet(private_nats: NatsServer,
                                                    stub_url: str) -> None:
    """What NATS coming back leaves until a service makes the layout again
    (the state stream, in memory, is always gone): reads find nothing yet, a
    write is refused as worth trying again, and nothing answers 500."""
    # No patience: a query the stream does not take is refused at once.
    with running_system(private_nats.url, stub_url, {"NATS_AWAY_PATIENCE_S": "0"},
                        services=("gateway",)) as system:
        async with system.http(timeout=30) as http:
            sid = (await http.post("/api/sessions", json={})).json()["session_id"]
            nc = await nats.connect(private_nats.url)
            js = nc.jetstream()
            try:
                for stream in (subjects.STATE_STREAM, subjects.HISTORY_STREAM):
                    await js.delete_stream(stream)
                session = await http.get(f"/api/sessions/{sid}")
                assert session.status_code == 200, session.text
                assert session.json()["messages"] == [] and session.json()["state"] == "idle"
                await js.delete_stream(subjects.QUERIES_STREAM)
                await the_query_is_refused_as_worth_retrying(http, sid)
                await js.delete_key_value(subjects.SESSIONS_BUCKET)
            finally:
                await nc.close()
            assert (await http.get(f"/api/sessions/{sid}")).status_code == 404
            listed = await http.get("/api/sessions")
            assert listed.status_code == 200 and listed.json() == {"sessions": []}
            created = await http.post("/api/sessions", json={})
            assert created.status_code == 503, created.text
            assert created.json()["error"]["code"] == "nats_unavailable"


async def test_a_query_the_stream_does_not_take_yet_is_offered_again_and_kept_once(
        private_nats: NatsServer, stub_url: str) -> None:
    """As while the QUERIES stream elects a leader: the gateway offers the
    query again under its id until the stream takes it, and its caller gets
    the answer, not 503."""
    with running_system(private_nats.url, stub_url, services=("gateway",)) as system:
        async with system.http(timeout=30) as http:
            sid = (await http.post("/api/sessions", json={})).json()["session_id"]
            nc = await nats.connect(private_nats.url)
            bus, js = Bus(nc, "test"), nc.jetstream()
            await js.delete_stream(subjects.QUERIES_STREAM)
            asked = asyncio.create_task(
                http.post(f"/api/sessions/{sid}/messages", json={"content": "hello"}))
            # Counted from its log: a subscriber on the subject would turn the
            # stream's absence into offers that each wait out a timeout.
            gateway = system["gateway"]
            await eventually(lambda: gateway.log().count("query_offered_again") >= 2,
                             "the query offered again twice")
            await ensure_layout(js)
            await eventually(lambda: last_query(js, sid), "the query stored")
            stored = await last_query(js, sid)
            assert stored is not None and stored.data is not None
            query = decode(stored.data, Query, subjects.query(sid))
            await bus.publish(subjects.reply(sid), Reply(
                session_id=sid, query_id=query.message_id, reply="an answer"),
                correlation_id=query.correlation_id, session_id=sid)
            answered = await asyncio.wait_for(asked, 30)
            info = await js.stream_info(subjects.QUERIES_STREAM)
            await nc.close()
    assert answered.status_code == 200, answered.text
    assert answered.json()["reply"] == "an answer"
    assert info.state.messages == 1


async def last_query(js: JetStreamContext, sid: str) -> RawStreamMsg | None:
    try:
        return await js.get_last_msg(subjects.QUERIES_STREAM, subjects.query(sid))
    except NotFoundError:
        return None


async def the_query_is_refused_as_worth_retrying(http: httpx.AsyncClient, sid: str) -> None:
    path, body = f"/api/sessions/{sid}/messages", {"content": "hello"}
    plain = await http.post(path, json=body)
    assert plain.status_code == 503, plain.text
    assert plain.json()["error"]["code"] == "nats_unavailable"
    async with http.stream("POST", path, json=body,
                           headers={"Accept": "text/event-stream"}) as response:
        events = [event async for event in server_sent_events(response)]
    assert [(name, data["error"]["code"]) for name, data in events] == [
        ("error", "nats_unavailable")]


async def test_a_decider_back_after_the_store_was_lost_reads_the_reports_sent_meanwhile(
        private_nats: NatsServer, stub_url: str) -> None:
    env = {"NUM_CTX": "2048", "COMPACTION_TAIL_TURNS": "1", "COMPACTION_COOLDOWN_S": "1",
           "COMPACTION_THRESHOLD": "0.1"}
    with running_system(private_nats.url, stub_url, env) as system:
        async with system.http(timeout=30) as http:
            system["decider"].signal(signal.SIGSTOP)  # back only once the turns are over
            private_nats.stop()
            private_nats.lose_store()
            private_nats.start()
            deadline = time.monotonic() + RECOVERY_S
            created = await answered_within(
                deadline, post(http, "/api/sessions", {}), 201, nothing_done)
            sid = created.json()["session_id"]
            async with watching(private_nats.url, subjects.COMPACTION_REQUEST,
                                subjects.COMPACTION_RESULT) as watcher:
                for turn in range(1, 7):
                    answer = await http.post(f"/api/sessions/{sid}/messages",
                                             json={"content": f"question {turn} !long 400"})
                    assert answer.status_code == 200, answer.text
                assert watcher.payloads("compaction.request") == []
                system["decider"].signal(signal.SIGCONT)
                request = await watcher.wait_for(
                    lambda e: e["message_type"] == "compaction.request")
                result = await watcher.wait_for(
                    lambda e: e["message_type"] == "compaction.result")
    assert request["payload"]["session_id"] == sid and request["payload"]["auto"] is True
    assert result["payload"]["status"] == "completed", result["payload"]



@dataclass
class CutOff:
    """A generator whose link to NATS a test cuts (the others keep theirs),
    in a system with a stand-in of its own, asked to compact a session whose
    summary is held until the link is cut."""

    system: System
    stub: str
    relay: Relay

    @property
    def generator(self) -> ServiceProcess:
        return self.system["generator"]

    async def compacting_when_cut(self, http: httpx.AsyncClient, first: str) -> str:
        """A session of two turns, the first `first`, compacting with the
        link cut and the summary let go; its id."""
        sid = (await http.post("/api/sessions", json={})).json()["session_id"]
        for content in (first, "two"):
            await http.post(f"/api/sessions/{sid}/messages", json={"content": content})
        await configure_stub(self.stub, held_models=["summariser"])
        asked = await http.post(f"/api/sessions/{sid}/compact")
        assert asked.status_code == 202, asked.text
        await model_called(self.stub, calls=3)  # the two answers, then the summary
        await self.relay.cut()
        await configure_stub(self.stub, held_models=[])
        return sid


@asynccontextmanager
async def generator_cut_off(nats: NatsServer, patience_s: float) -> AsyncIterator[CutOff]:
    env = {"COMPACTION_MODEL": "summariser", "COMPACTION_TAIL_TURNS": "1",
           "NATS_AWAY_PATIENCE_S": str(patience_s)}
    async with relay_to(nats.url) as relay:
        with running_stub() as stub:
            system = System(nats.url, stub, env, services=("gateway",))
            system.add("generator", SERVICE_MODULES["generator"], {"NATS_URL": relay.url})
            try:
                await asyncio.to_thread(system.start)  # the relay needs this loop meanwhile
                yield CutOff(system, stub, relay)
            finally:
                await asyncio.to_thread(system.stop)


async def test_a_compaction_whose_end_nats_missed_is_ended_once_nats_is_back(
        private_nats: NatsServer) -> None:
    """The generator's link to NATS cut as a compaction ended: its end was
    tried once, the entry stayed in the running-compactions bucket, and the
    session read `compacting` until it was deleted."""
    async with generator_cut_off(private_nats, patience_s=1) as cut, \
            cut.system.http(timeout=30) as http:
        sid = await cut.compacting_when_cut(http, "one")
        await asyncio.to_thread(cut.generator.wait_for, "compaction_record_failed", 60)
        await cut.relay.restore()

        async def not_compacting() -> bool:
            response = await http.get(f"/api/sessions/{sid}")
            return response.status_code == 200 and response.json()["state"] != "compacting"

        await eventually(not_compacting, "the session no longer compacting", 60)


async def test_a_compaction_whose_summary_is_written_while_nats_is_away_is_spliced(
        private_nats: NatsServer) -> None:
    """The summary written, the session's lock could not be taken with the
    generator's link to NATS cut: the compaction was logged as a crash and
    its summary thrown away. The lock is now taken patiently, as a turn's
    history write is."""
    async with generator_cut_off(private_nats, patience_s=120) as cut, \
            cut.system.http(timeout=30) as http:
        # Enough said that a summary frees something.
        sid = await cut.compacting_when_cut(http, "one " * 300)

        def met_nats_away() -> bool:
            log = cut.generator.log()
            return "compaction_lock_tried_again" in log or "compaction_crashed" in log

        await asyncio.to_thread(until, met_nats_away, "the splice meeting NATS away", 60)
        await cut.relay.restore()

        async def compacted() -> bool:
            response = await http.get(f"/api/sessions/{sid}")
            return response.status_code == 200 and response.json()["compactions"] == 1

        await eventually(compacted, "the summary spliced", 60)


async def test_a_message_sent_while_nats_is_away_waits_for_it(
        private_nats: NatsServer, stub_url: str) -> None:
    """A message first reads the session's record (the gateway's first of the
    session) or, under an Idempotency-Key, its history; those reads answered
    503 after NATS's own 5 s, well inside NATS_AWAY_PATIENCE_S."""
    with running_system(private_nats.url, stub_url, {"NATS_AWAY_PATIENCE_S": "120"},
                        services=("generator", "gateway")) as system:
        async with system.http(timeout=120) as http:
            known, fresh = [(await http.post("/api/sessions", json={})).json()["session_id"]
                            for _ in range(2)]
            assert (await http.post(f"/api/sessions/{known}/messages",
                                    json={"content": "before"})).status_code == 200
            private_nats.stop()
            sent = [asyncio.create_task(http.post(
                        f"/api/sessions/{known}/messages", json={"content": "keyed"},
                        headers={"Idempotency-Key": "sent-while-away"})),
                    asyncio.create_task(http.post(f"/api/sessions/{fresh}/messages",
                                                  json={"content": "first"}))]
            gateway = system["gateway"]

            def waited_or_answered() -> bool:
                log = gateway.log()
                return all(task.done() for task in sent) or (
                    "history_read_tried_again" in log and "session_read_tried_again" in log)

            await eventually(waited_or_answered, "the gateway waiting for NATS", 60)
            private_nats.start()
            keyed, first = [await task for task in sent]
    assert keyed.status_code == 200, keyed.text
    assert keyed.json()["reply"] == "Echo: keyed (turn 2)"
    assert first.status_code == 200, first.text


async def test_reads_a_new_session_and_a_compaction_wait_for_nats_as_a_message_does(
        private_nats: NatsServer, stub_url: str) -> None:
    """Only a message was patient: a read, a new session, a compaction or a retry asked
    for while NATS was away answered 503 after NATS's own 5 s, well inside
    NATS_AWAY_PATIENCE_S, and a new session stored all the same was a
    duplicate once the caller tried again."""
    with running_system(private_nats.url, stub_url, {"NATS_AWAY_PATIENCE_S": "120"},
                        services=("generator", "gateway")) as system:
        async with system.http(timeout=120) as http:
            sid, other = [(await http.post("/api/sessions", json={})).json()["session_id"]
                          for _ in range(2)]
            for session in (sid, other):
                assert (await http.post(f"/api/sessions/{session}/messages",
                                        json={"content": "before"})).status_code == 200
            private_nats.stop()
            asked = [asyncio.create_task(http.get("/api/sessions")),
                     asyncio.create_task(http.get(f"/api/sessions/{sid}")),
                     asyncio.create_task(http.get(f"/api/sessions/{sid}/transcript")),
                     asyncio.create_task(http.post("/api/sessions", json={})),
                     asyncio.create_task(http.post(f"/api/sessions/{sid}/compact")),
                     asyncio.create_task(http.post(f"/api/sessions/{other}/retry"))]
            gateway = system["gateway"]

            def waiting() -> bool:
                log = gateway.log()
                return all(task.done() for task in asked) or all(event in log for event in (
                    "read_tried_again", "session_create_tried_again", "retry_read_tried_again"))

            await eventually(waiting, "the gateway waiting for NATS", 60)
            private_nats.start()
            answers = [await task for task in asked]
            assert [r.status_code for r in answers] == [200, 200, 200, 201, 202, 200], [
                r.text for r in answers]
            sessions = (await http.get("/api/sessions")).json()["sessions"]
    assert len(sessions) == 3  # the one made while away, once

