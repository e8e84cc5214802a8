"""The system on a three-node NATS cluster with every stream and bucket
replicated three times (JETSTREAM_REPLICAS=3): 32 sessions talk and compact
while the node leading the HISTORY stream is SIGKILLed, then restarted.

No acknowledged turn may be lost or doubled, no session may stay locked past
its lease, and the services must carry on as they are, without a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import nats
import pytest
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from pydantic import ValidationError

from schemas import subjects
from services.generator.session_lock import free_marker_of
from services.shared.jetstream import (
    ReplicasMismatch,
    bucket_keys,
    ensure_layout,
    locks_bucket,
)
from services.shared.settings import ServiceSettings, nats_servers
from tests.events import eventually, watching
from tests.nats_cluster import NatsCluster, running_cluster
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, model_called, running_stub
from tests.system import System

SESSIONS = 32
TURNS = 8  # acknowledged turns each session makes
# A small window, so that a few `!long` answers call for a compaction.
ENV = {"NUM_CTX": "2048", "COMPACTION_TAIL_TURNS": "2", "COMPACTION_COOLDOWN_S": "1",
       "JETSTREAM_REPLICAS": "3"}
LEASE_S = 2.0  # LOCK_LEASE_S of tests.system
# Seconds during which turns failed: an election takes a few (0 to 8 measured
# on two loaded cores); far more would mean the services did not fail over.
MOST_ERROR_SECONDS = 20
# The generator's NATS_AWAY_PATIENCE_S in the test of a reply missed, and a
# publish timeout past it: what it tests is the gateway's look for the reply,
# not how long an election may take on two loaded cores (over 40 s, once).
PATIENCE_S = 120
REPLY_WAIT_S = PATIENCE_S + 10.0


@dataclass
class Load:
    """What the sessions' clients saw: each acknowledged turn, each failure."""

    acked: dict[str, list[str]] = field(default_factory=dict)
    error_times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    total: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def answered(self, sid: str, content: str) -> None:
        self.acked[sid].append(content)
        async with self.changed:
            self.total += 1
            self.changed.notify_all()

    async def until(self, total: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.total >= total)

    def error_seconds(self) -> int:
        """Distinct seconds in which at least one turn failed."""
        return len({int(t) for t in self.error_times})


@pytest.fixture
async def cluster() -> AsyncIterator[NatsCluster]:
    async with running_cluster(3) as started:
        yield started


async def converse(http: httpx.AsyncClient, sid: str, compacting: bool, load: Load) -> None:
    """TURNS acknowledged turns; a failed turn is not repeated (a new text goes
    next) so that no text can be in the history twice by the client's doing."""
    attempt = 0
    while len(load.acked[sid]) < TURNS and attempt < TURNS * 20:
        attempt += 1
        content = f"{sid} turn {attempt}" + (" !long 1200" if compacting else "")
        try:
            response = await http.post(f"/api/sessions/{sid}/messages",
                                       json={"content": content})
        except httpx.TransportError as err:
            response, failure = None, f"{type(err).__name__}"
        else:
            failure = "" if response.status_code == 200 else response.text[:200]
        if response is not None and not failure:
            await load.answered(sid, content)
            continue
        load.error_times.append(time.monotonic())
        load.errors.append(failure)
        await asyncio.sleep(0.2)  # a client's pause before its next try


async def history_leader(url: str) -> str:
    nc = await nats.connect(url.split(","))
    try:
        info = await nc.jetstream().stream_info(subjects.HISTORY_STREAM)
        assert info.cluster is not None and info.cluster.leader
        return info.cluster.leader
    finally:
        await nc.close()


async def kill_and_restart_the_leader(cluster: NatsCluster, load: Load) -> str:
    await load.until(SESSIONS * TURNS // 3)
    leader = await history_leader(cluster.url)
    cluster.kill(leader)
    await load.until(SESSIONS * TURNS * 2 // 3)
    cluster.restart(leader)
    return leader


def assert_each_acknowledged_turn_once(session: dict[str, object], acked: list[str]) -> None:
    messages = session["messages"]
    assert isinstance(messages, list)
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert len(users) == len(set(users)), f"a turn is in the history twice: {users}"
    if not session["compactions"]:
        kept = acked
    else:  # the turns before the kept tail are in the summary
        first_kept = next((i for i, c in enumerate(acked) if c in users), len(acked))
        kept = acked[first_kept:]
    missing = [c for c in kept if c not in users]
    assert not missing, f"acknowledged but not in the history: {missing}"
    assert [c for c in users if c in kept] == kept  # in the order they were answered


async def assert_no_lock_outlives_its_lease(url: str) -> None:
    nc = await nats.connect(url.split(","))
    try:
        js = nc.jetstream()
        kv = await js.key_value(subjects.LOCKS_BUCKET)
        deadline = time.monotonic() + 3 * LEASE_S
        while True:
            held = await held_locks(js, kv)
            if not held or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert not held, f"locked past the lease: {held}"
    finally:
        await nc.close()


async def held_locks(js: JetStreamContext, kv: nats.js.kv.KeyValue) -> list[str]:
    held = []
    for key in await bucket_keys(js, subjects.LOCKS_BUCKET):
        try:
            if free_marker_of((await kv.get(key)).value) is None:
                held.append(key)
        except KeyNotFoundError:  # lapsed: the lease is over
            pass
    return held


async def assert_replicated(url: str, replicas: int) -> None:
    nc = await nats.connect(url.split(","))
    try:
        for info in await nc.jetstream().streams_info():
            assert info.config.num_replicas == replicas, info.config.name
    finally:
        await nc.close()


@pytest.mark.timeout(240)
async def test_the_history_leader_killed_mid_load_loses_no_acknowledged_turn(
        cluster: NatsCluster) -> None:
    with running_stub() as stub:
        system = System(cluster.url, stub, ENV, services=("generator", "decider", "gateway"))
        system.add("second generator", "services.generator")
        system.start()
        try:
            async with system.http(timeout=60) as http:
                await run_and_check(cluster, system, http)
        finally:
            system.stop()


async def run_and_check(cluster: NatsCluster, system: System, http: httpx.AsyncClient) -> None:
    await assert_replicated(cluster.url, 3)
    load = Load()
    compacting = {}
    for i in range(SESSIONS):
        response = await http.post("/api/sessions", json={"auto_compact": i % 2 == 0})
        sid = str(response.json()["session_id"])
        load.acked[sid], compacting[sid] = [], i % 2 == 0
    killer = asyncio.create_task(kill_and_restart_the_leader(cluster, load))
    await asyncio.gather(*(converse(http, sid, compacting[sid], load) for sid in load.acked))
    leader = await killer
    print(f"\nkilled {leader}; {len(load.error_times)} failed turns in"
          f" {load.error_seconds()} s: {sorted(set(load.errors))[:5]}")
    for name, process in system.processes.items():
        assert process.proc is not None and process.proc.poll() is None, name
    assert all(len(turns) == TURNS for turns in load.acked.values()), system.logs()
    sessions = {sid: (await http.get(f"/api/sessions/{sid}")).json() for sid in load.acked}
    for sid, session in sessions.items():
        assert_each_acknowledged_turn_once(session, load.acked[sid])
    assert any(s["compactions"] for s in sessions.values()), system.logs()
    await assert_no_lock_outlives_its_lease(cluster.url)
    assert load.error_seconds() <= MOST_ERROR_SECONDS
    await assert_replicated(cluster.url, 3)


def diagnosis(system: System, cluster: NatsCluster) -> str:
    """What the services and the nodes logged last: a stall across a node's
    death is seldom seen, and these say where it was."""
    nodes = "\n".join(f"--- node {name}\n{node.log()[-8000:]}"
                      for name, node in cluster.nodes.items())
    return f"{system.logs(tail=12000)}\n{nodes}"


# Its waits, one after the other, may take longer than the suite's timeout.
@pytest.mark.timeout(int(2 * REPLY_WAIT_S + 60))
async def test_a_reply_sent_while_the_gateway_was_away_still_reaches_its_caller() -> None:
    """Replies are core NATS messages: one sent while the gateway's node is
    down is lost. The turn is stored first, so the gateway, back, finds it."""
    async with running_cluster(3, advertise=False) as cluster, watching(
            cluster.nodes["n2"].url, f"{subjects.REPLY_PREFIX}.*") as replies:
        with running_stub() as stub:
            # The gateway is away when the reply goes: only its own look can save it.
            # A turn whose lock's bucket lost its leader with the node hands its
            # query back, and a hand-back sent during the queue's own election
            # is lost: the query then comes back after its acknowledgement wait.
            system = System(cluster.nodes["n2"].url, stub, {
                **ENV, "QUERY_ACK_WAIT_S": "20", "NATS_AWAY_PATIENCE_S": str(PATIENCE_S)},
                services=("generator",))
            gateway = system.add("gateway", "services.gateway",
                                 {"NATS_URL": cluster.nodes["n1"].url,
                                  "REPLY_TIMEOUT_S": str(REPLY_WAIT_S + 20)})
            system.start()
            try:
                async with system.http(timeout=REPLY_WAIT_S + 30) as http:
                    sid = (await http.post("/api/sessions", json={})).json()["session_id"]
                    await configure_stub(stub, held_models=["stub-model"])
                    asking = asyncio.create_task(http.post(f"/api/sessions/{sid}/messages",
                                                           json={"content": "while away"}))
                    await model_called(stub)
                    cluster.kill("n1")
                    await eventually(lambda: "nats_disconnected" in gateway.log(),
                                     "the gateway cut off")
                    await configure_stub(stub, held_models=[])
                    # Stores the turn first: through a leader election under load,
                    # tried again while NATS does not answer (up to its patience).
                    await replies.wait_for(lambda e: e["payload"]["session_id"] == sid,
                                           timeout_s=REPLY_WAIT_S)
                    cluster.restart("n1")
                    answer = await asyncio.wait_for(asking, REPLY_WAIT_S + 30)
            except BaseException:
                print(diagnosis(system, cluster))  # shown with the failure
                raise
            finally:
                system.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["reply"] == "Echo: while away (turn 1)"
    assert "missed_reply_recovered" in gateway.log()


async def test_a_layout_made_with_one_replica_is_moved_to_three(cluster: NatsCluster) -> None:
    nc = await nats.connect(cluster.url.split(","))
    try:
        await ensure_layout(nc.jetstream())  # as a single-server deployment left it
        # Every bucket is part of the layout, the live settings' too, so every one is moved.
        await nc.jetstream().key_value(subjects.CONFIG_BUCKET)
        await assert_replicated(cluster.url, 1)
        await ensure_layout(nc.jetstream(), replicas=3, move_replicas=True)
    finally:
        await nc.close()
    await assert_replicated(cluster.url, 3)


async def test_a_layout_is_made_with_its_replicas_from_the_first(cluster: NatsCluster) -> None:
    """Not made with one copy and moved to three: a bucket moved so takes no
    writes for about 5 s, the first turns' locks among them."""
    nc = await nats.connect(cluster.url.split(","))
    try:
        await ensure_layout(nc.jetstream(), replicas=3)  # as a service not the owner does
    finally:
        await nc.close()
    await assert_replicated(cluster.url, 3)


async def test_more_replicas_than_the_servers_is_reported_when_made(
        private_nats: NatsServer) -> None:
    nc = await nats.connect(private_nats.url)
    try:
        with pytest.raises(ReplicasMismatch, match=r"stream .* cannot be made"):
            await ensure_layout(nc.jetstream(), replicas=3)
        with pytest.raises(ReplicasMismatch, match=r"bucket .* cannot be made"):
            await locks_bucket(nc.jetstream(), None, replicas=3)
    finally:
        await nc.close()


async def test_more_replicas_than_the_servers_is_reported_by_stream(
        private_nats: NatsServer) -> None:
    nc = await nats.connect(private_nats.url)
    try:
        await ensure_layout(nc.jetstream())
        with pytest.raises(ReplicasMismatch, match="JETSTREAM_REPLICAS is 3"):
            await ensure_layout(nc.jetstream(), replicas=3, move_replicas=True)
    finally:
        await nc.close()


def test_nats_url_may_list_several_servers() -> None:
    settings = ServiceSettings(nats_url="nats://a:4222, nats://b:4222,nats://c:4222")
    assert nats_servers(settings.nats_url) == ["nats://a:4222", "nats://b:4222",
                                               "nats://c:4222"]
    with pytest.raises(ValidationError, match="NATS_URL names no server"):
        ServiceSettings(nats_url=" , ")
