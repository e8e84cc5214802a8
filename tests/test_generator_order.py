"""A session's queries stay in order when an earlier one is stuck: its
acknowledgement lost, or its generator dead before answering. The generator
runs in this process on a server of the test's own, with the Ollama
stand-in."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import CompactionRequest, Query, Reply
from schemas.session import SessionRecord
from services.generator.service import QUERY_CONSUMER, build
from services.generator.settings import GeneratorSettings
from services.shared.bus import Bus, decode
from services.shared.history_store import HistoryStore
from services.shared.jetstream import ensure_layout
from services.shared.sessions import SessionStore
from tests.events import consumer_caught_up, watching
from tests.nats_server import NatsServer
from tests.test_generator_crashes import (
    acks_refused,
    queries_consumer,
    taken_and_never_acknowledged,
)

SID = "ordered"
ACKS_ALLOWED = """authorization {
  users = [{user: generator, password: generator}]
}"""


@dataclass
class Replies:
    """The replies the generator sends for the session, by query id."""

    got: list[Reply] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_reply(self, msg: Msg) -> None:
        self.got.append(decode(msg.data, Reply, msg.subject).payload)
        self.arrived.set()

    async def wait_for(self, query_id: str, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            while query_id not in self.order():
                self.arrived.clear()
                await self.arrived.wait()

    def order(self) -> list[str]:
        """Query ids in the order of their first replies."""
        return list(dict.fromkeys(r.query_id for r in self.got))


@contextlib.asynccontextmanager
async def generator_on(url: str, settings: GeneratorSettings
                       ) -> AsyncIterator[tuple[Bus, Replies]]:
    nc = await nats.connect(url)
    bus = Bus(nc, "generator", settings.jetstream_replicas)
    await ensure_layout(bus.js, settings.lock_lease_s)
    await (await SessionStore.open(bus.js)).create(SessionRecord(session_id=SID))
    replies = Replies()
    await nc.subscribe(subjects.reply(SID), cb=replies.on_reply)
    generator = await build(bus, settings)
    await generator.start()
    try:
        yield bus, replies
    finally:
        await generator.stop()
        await nc.close()


async def ask(bus: Bus, content: str) -> str:
    """Publish a query (stored once this returns, so the order is known); its id."""
    env, _ = await bus.js_publish(subjects.query(SID), Query(session_id=SID, content=content),
                                  session_id=SID)
    return env.message_id


async def test_a_lost_acknowledgement_keeps_later_queries_waiting(stub_url: str) -> None:
    """The first query's acknowledgement is refused: it will come back. The
    caller's next queries must wait for it rather than run first, or a
    compaction in between folds the first turn away and its redelivery is
    answered again after them (the history once read Q3, Q1, Q2)."""
    settings = GeneratorSettings(ollama_host=stub_url, model="stub-model",
                                 query_ack_wait_s=3, lock_lease_s=2, compaction_tail_turns=1)
    with acks_refused() as (server, url):
        async with generator_on(url, settings) as (bus, replies), \
                watching(url, subjects.COMPACTION_RESULT) as results:
            first = await ask(bus, "one " * 60)
            await replies.wait_for(first)
            later = [await ask(bus, "two " * 60), await ask(bus, "three " * 60)]
            await answered_or_back(bus, replies, later[-1])
            await bus.js_publish(subjects.COMPACTION_REQUEST,
                                 CompactionRequest(session_id=SID, auto=False), session_id=SID)
            await results.wait_until(lambda: bool(results.payloads("compaction.result")))
            server.reload(ACKS_ALLOWED)  # acknowledgements get through from now on
            await consumer_caught_up(url, subjects.QUERIES_STREAM, QUERY_CONSUMER,
                                     timeout_s=60)
            view = await HistoryStore(bus.js).read(SID)
    asked = [first, *later]
    assert replies.order() == asked
    stored = [m.query_id for m in view.conversation.messages if m.role == "user"]
    assert len(set(stored)) == len(stored) and stored[-1] == asked[-1], "answered twice"
    assert [*view.conversation.compacted_query_ids, *stored] == asked


async def answered_or_back(bus: Bus, replies: Replies, query_id: str) -> None:
    """Until the query is answered, or a query has come back (the first, its
    acknowledgement refused, or a later one handed back to wait for it)."""
    async with asyncio.timeout(30):
        while query_id not in replies.order():
            info = await bus.js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
            if info.num_redelivered:
                return
            await asyncio.sleep(0.05)


async def lock_writes(bus: Bus) -> int:
    return int((await bus.js.stream_info(f"KV_{subjects.LOCKS_BUCKET}")).state.last_seq)


async def deliveries(bus: Bus) -> int:
    info = await bus.js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
    return int(info.delivered.consumer_seq or 0)


async def test_a_later_query_waits_for_a_dead_generators_query_without_spinning(
        private_nats: NatsServer, stub_url: str) -> None:
    """The first query went to a generator that died with it: it comes back
    only after the ack wait. Meanwhile the second is handed back again and
    again; it must neither take and free the session lock each time (two
    written lock records) nor come back every 20 ms (once 456 lock writes in
    5 s), and it is answered after the first."""
    settings = GeneratorSettings(ollama_host=stub_url, model="stub-model",
                                 query_ack_wait_s=3, lock_lease_s=2)
    nc = await nats.connect(private_nats.url)
    await queries_consumer(nc, settings)
    first = await ask(Bus(nc, "gateway"), "one")
    taken = await taken_and_never_acknowledged(nc.jetstream())
    assert taken.metadata.sequence.stream == 1
    async with generator_on(private_nats.url, settings) as (bus, replies):
        writes, delivered = await lock_writes(bus), await deliveries(bus)
        second = await ask(bus, "two")
        await replies.wait_for(second, timeout_s=30)
        writes, delivered = (await lock_writes(bus) - writes,
                             await deliveries(bus) - delivered)
    await nc.close()
    assert replies.order() == [first, second]
    # Each turn takes and frees the lock once (and renews it if slow), and so
    # may the second query's first delivery; before, every hand-back did.
    assert writes <= 12, f"{writes} lock writes while the second query waited"
    assert delivered <= 20, f"the second query came back {delivered} times"


@pytest.mark.parametrize(("replicas", "api"), [(1, "DIRECT.GET"), (3, "STREAM.MSG.GET")])
async def test_with_replicas_the_order_is_read_from_the_streams_leader(
        private_nats: NatsServer, stub_url: str, replicas: int, api: str) -> None:
    """A direct get may be answered by a replica that has not stored the
    earlier query yet: with replicas, the ordering check asks the leader.
    (The layout here has one replica; only the generator's reads change.)"""
    settings = GeneratorSettings(ollama_host=stub_url, model="stub-model",
                                 jetstream_replicas=replicas)
    async with generator_on(private_nats.url, settings) as (bus, replies), \
            watching(private_nats.url, f"$JS.API.*.*.{subjects.QUERIES_STREAM}",
                     f"$JS.API.*.*.*.{subjects.QUERIES_STREAM}") as api_calls:
        await replies.wait_for(await ask(bus, "hello"))
    asked = {e["subject"].removeprefix("$JS.API.").removesuffix(f".{subjects.QUERIES_STREAM}")
             for e in api_calls.events}
    reads = asked & {"DIRECT.GET", "STREAM.MSG.GET"}
    assert reads == {api}, asked
