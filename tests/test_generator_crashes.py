"""A generator after a crash or a lost acknowledgement, on a real NATS, in
process, with a test model in place of Ollama: its own handler crashing (a
bug, not a model failure) is retried a few times, then answered with an
error; a query whose answer was stored by a generator that died before
acknowledging it is answered from history; a query answered with an error
whose acknowledgement never arrived gets the same error again, from any
generator, and is not answered anew."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import nats
import structlog
import structlog.testing
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import ServiceUnavailableError

from schemas import subjects
from schemas.history import ChatMessage, Snapshot
from schemas.messages import Query, Reply
from schemas.session import SessionRecord
from services.core.decision import Policy
from services.core.failed_tries import MAX_CRASHES
from services.generator.models import ModelFacts
from services.generator.provider import ChatRequest, ChatResult, OnToken, ProviderError
from services.generator.queries import raised_in
from services.generator.service import QUERY_CONSUMER, Generator, work_queue_consumer
from services.generator.session_lock import SessionLocks
from services.generator.settings import GeneratorSettings
from services.shared.bus import Bus, decode
from services.shared.consumer import ensure_consumer
from services.shared.history_store import HistoryStore
from services.shared.jetstream import ensure_layout, locks_bucket
from services.shared.query_errors import QueryErrors
from services.shared.sessions import SessionStore
from tests.events import eventually
from tests.nats_server import NatsServer, running_nats

SID = "crashing"
LOCK_WAIT_S = 0.2


class BrokenModel:
    """A model client that fails in a way no provider error covers."""

    def __init__(self) -> None:
        self.calls = 0

    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult:
        self.calls += 1
        raise RuntimeError("a bug in the model client")

    async def facts(self, model: str) -> ModelFacts:
        return ModelFacts()

    async def close(self) -> None:
        pass


class Answering(BrokenModel):
    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult:
        self.calls += 1
        return ChatResult(content="an answer")


class UnreachableOnce(BrokenModel):
    """Unreachable on the first call, as Ollama is while it restarts; then it answers."""

    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult:
        self.calls += 1
        if self.calls == 1:
            raise ProviderError("ollama_unreachable", "Ollama is not reachable")
        return ChatResult(content="a late answer")


# The generator may publish anything but the acknowledgements of queries: each
# is refused by the server, so every query comes back after the ack wait.
ACKS_REFUSED = """authorization {
  users = [
    {user: generator, password: generator,
     permissions: {publish: {allow: ">", deny: "$JS.ACK.QUERIES.>"}}}
  ]
}"""


@contextlib.contextmanager
def acks_refused() -> Iterator[tuple[NatsServer, str]]:
    """A server of its own refusing every query's acknowledgement, and the
    address a generator connects to it at."""
    with running_nats(ACKS_REFUSED) as server:
        yield server, server.url.replace("nats://", "nats://generator:generator@")


async def queries_consumer(nc: NATS, settings: GeneratorSettings) -> None:
    """The layout and the generators' shared consumer of queries, as they make them."""
    await ensure_layout(nc.jetstream(), settings.lock_lease_s)
    await ensure_consumer(nc, subjects.QUERIES_STREAM, work_queue_consumer(
        QUERY_CONSUMER, f"{subjects.QUERY_PREFIX}.*", settings.query_ack_wait_s))


async def taken_and_never_acknowledged(js: JetStreamContext) -> Msg:
    """The next query, taken by a generator that dies with it: it comes back
    only after the ack wait."""
    dying = await js.pull_subscribe_bind(QUERY_CONSUMER, subjects.QUERIES_STREAM)
    [taken] = await dying.fetch(1, timeout=5)
    await dying.unsubscribe()
    return taken


@dataclass
class Rig:
    """A generator running in this process with a test model, and the
    replies it sends for the session."""

    bus: Bus
    model: BrokenModel
    replies: asyncio.Queue[Reply]


@contextlib.asynccontextmanager
async def in_process_generator(nats_url: str, settings: GeneratorSettings,
                               model: BrokenModel | None = None, new_session: bool = True
                               ) -> AsyncIterator[Rig]:
    nc = await nats.connect(nats_url)
    bus = Bus(nc, "generator")
    await ensure_layout(bus.js, settings.lock_lease_s)
    sessions = await SessionStore.open(bus.js)
    if new_session:
        await sessions.create(SessionRecord(session_id=SID))
    rig = Rig(bus, model or BrokenModel(), asyncio.Queue())
    generator = Generator(bus, settings, rig.model, sessions, SessionLocks(
        await locks_bucket(bus.js, settings.lock_lease_s), settings.generator_id,
        settings.lock_lease_s, settings.lock_wait_s))

    async def on_reply(msg: Msg) -> None:
        rig.replies.put_nowait(decode(msg.data, Reply, msg.subject).payload)

    await nc.subscribe(subjects.reply(SID), cb=on_reply)
    await generator.start()
    try:
        yield rig
    finally:
        await generator.stop()
        await nc.close()


async def test_a_query_whose_answer_was_stored_is_answered_from_history(
        private_nats: NatsServer) -> None:
    """The turn was appended, then its generator died before the acknowledgement:
    the redelivered query gets the stored answer, and the model is not asked."""
    async with in_process_generator(private_nats.url, GeneratorSettings(model="stub-model")) as rig:
        history = HistoryStore(rig.bus.js)
        await history.append(SID, await history.read(SID), [
            ChatMessage(role="user", content="hi", query_id="q-1"),
            ChatMessage(role="assistant", content="stored answer", query_id="q-1")])
        await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                 session_id=SID, message_id="q-1")
        reply = await asyncio.wait_for(rig.replies.get(), 10)
        assert (reply.reply, reply.error) == ("stored answer", None)
        assert rig.model.calls == 0
        assert len((await history.read(SID)).conversation.messages) == 2


async def test_a_stopped_answer_sent_again_from_history_says_it_was_stopped(
        private_nats: NatsServer) -> None:
    async with in_process_generator(private_nats.url, GeneratorSettings(model="stub-model")) as rig:
        history = HistoryStore(rig.bus.js)
        await history.append(SID, await history.read(SID), [
            ChatMessage(role="user", content="tell me all", query_id="q-1"),
            ChatMessage(role="assistant", content="the part before", query_id="q-1",
                        stopped=True)])
        await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="tell me all"),
                                 session_id=SID, message_id="q-1")
        reply = await asyncio.wait_for(rig.replies.get(), 10)
        assert (reply.reply, reply.stopped) == ("the part before", True)
        assert rig.model.calls == 0


async def test_a_query_whose_turn_was_compacted_is_not_answered_again(
        private_nats: NatsServer) -> None:
    """Its answer is in the summary now, and later turns follow it: answered
    afresh, it would land after them. The snapshot lists the folded queries."""
    async with in_process_generator(private_nats.url, GeneratorSettings(model="stub-model")) as rig:
        history = HistoryStore(rig.bus.js)
        later = [ChatMessage(role="user", content="later", query_id="q-2"),
                 ChatMessage(role="assistant", content="later answer", query_id="q-2")]
        await history.splice(SID, await history.read(SID), Snapshot(
            summary="q-1 was asked and answered", messages=tuple(later), compactions=1,
            compacted_query_ids=("q-1",)))
        await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                 session_id=SID, message_id="q-1")
        reply = await asyncio.wait_for(rig.replies.get(), 10)
        assert (reply.query_id, reply.error_code) == ("q-1", "already_answered")
        assert rig.model.calls == 0
        assert (await history.read(SID)).conversation.messages == tuple(later)


async def deliveries(js: JetStreamContext, at_least: int) -> bool:
    """Whether the generator's consumer has made `at_least` deliveries (one
    query here, so each after the first is the query coming back)."""
    info = await js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
    return info.delivered.consumer_seq >= at_least


async def test_waiting_for_the_lock_does_not_use_up_the_retries(
        private_nats: NatsServer) -> None:
    """The query is handed back twice while the lock is held elsewhere (it is
    delivered a third time), then crashes: it is still tried MAX_CRASHES times
    before the caller gets `internal_error`."""
    settings = GeneratorSettings(model="stub-model", lock_wait_s=LOCK_WAIT_S, lock_lease_s=2)
    async with in_process_generator(private_nats.url, settings) as rig:
        elsewhere = SessionLocks(await locks_bucket(rig.bus.js, settings.lock_lease_s),
                                 "elsewhere", settings.lock_lease_s, 1.0)
        async with elsewhere.hold(SID, "query"):
            await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                     session_id=SID)
            await eventually(lambda: deliveries(rig.bus.js, 3),
                             "two lock timeouts, each handing the query back")
            assert rig.model.calls == 0
        reply = await asyncio.wait_for(rig.replies.get(), 15)
        assert reply.error_code == "internal_error"
        assert rig.model.calls == MAX_CRASHES


async def test_an_error_answer_whose_acknowledgement_is_lost_is_sent_again_not_redone() -> None:
    """The caller was told the model was unreachable. If the query came back
    and were answered anew, the history would gain a turn the caller was told
    had failed, after the session's later queries."""
    settings = GeneratorSettings(model="stub-model", query_ack_wait_s=1)
    with acks_refused() as (_, url):
        async with in_process_generator(url, settings, UnreachableOnce()) as rig:
            await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                     session_id=SID)
            # Delivered three times: every acknowledgement is refused.
            replies = [await asyncio.wait_for(rig.replies.get(), 10) for _ in range(3)]
            assert [r.error_code for r in replies] == ["ollama_unreachable"] * 3
            assert len({r.query_id for r in replies}) == 1
            assert rig.model.calls == 1
            assert not (await HistoryStore(rig.bus.js).read(SID)).conversation.messages


async def test_an_error_answer_comes_back_to_another_generator_the_same() -> None:
    """The generator that answered with an error is gone before its
    acknowledgement counted; the query comes back to one that never saw it."""
    settings = GeneratorSettings(model="stub-model", query_ack_wait_s=1)
    with acks_refused() as (_, url):
        async with in_process_generator(url, settings, UnreachableOnce()) as first:
            await first.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                       session_id=SID)
            told = await asyncio.wait_for(first.replies.get(), 10)
            assert told.error_code == "ollama_unreachable"
        async with in_process_generator(url, settings, Answering(), new_session=False) as other:
            again = await asyncio.wait_for(other.replies.get(), 10)
            assert (again.query_id, again.error_code) == (told.query_id, "ollama_unreachable")
            assert other.model.calls == 0
            assert not (await HistoryStore(other.bus.js).read(SID)).conversation.messages


async def test_a_query_told_nats_unavailable_whose_turn_was_stored_gets_that_answer(
        private_nats: NatsServer) -> None:
    """NATS took the turn's write but its acknowledgement never came back in
    time: the caller was told 503, the error kept, and the generator died
    before acknowledging the query. The one it comes back to answers from
    the history, not with the kept 503."""
    settings = GeneratorSettings(model="stub-model", query_ack_wait_s=1)
    nc = await nats.connect(private_nats.url)
    js = nc.jetstream()
    await queries_consumer(nc, settings)
    env, _ = await Bus(nc, "gateway").js_publish(
        subjects.query(SID), Query(session_id=SID, content="hi"), session_id=SID)
    await taken_and_never_acknowledged(js)
    history = HistoryStore(js)
    await history.append(SID, await history.read(SID), [
        ChatMessage(role="user", content="hi", query_id=env.message_id),
        ChatMessage(role="assistant", content="stored after all", query_id=env.message_id)])
    await QueryErrors(js).keep(Reply(session_id=SID, query_id=env.message_id,
                                     error_code="nats_unavailable", error="NATS away"), "hi")
    async with in_process_generator(private_nats.url, settings, Answering()) as rig:
        reply = await asyncio.wait_for(rig.replies.get(), 15)
    await nc.close()
    assert (reply.query_id, reply.reply, reply.error_code) == (
        env.message_id, "stored after all", None)
    assert rig.model.calls == 0


async def test_a_lock_nats_has_no_room_for_is_told_as_storage_full_at_once(
        private_nats: NatsServer) -> None:
    """The store is full when a turn would take its session's lock: the caller
    hears storage_full at once, not a crash tried again and again."""
    settings = GeneratorSettings(model="stub-model")
    nc = await nats.connect(private_nats.url)
    locks = await nc.jetstream().create_key_value(KeyValueConfig(
        bucket=subjects.LOCKS_BUCKET, history=1, ttl=settings.lock_lease_s, max_bytes=400))
    with contextlib.suppress(ServiceUnavailableError):  # full
        for key in range(100):
            await locks.put(f"other-{key}", b"x" * 60)
    await nc.close()
    with structlog.testing.capture_logs() as logs:
        async with in_process_generator(private_nats.url, settings, Answering()) as rig:
            await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                     session_id=SID)
            reply = await asyncio.wait_for(rig.replies.get(), 15)
            stored = (await HistoryStore(rig.bus.js).read(SID)).conversation.messages
    assert reply.error_code == "storage_full" and reply.error
    assert "nothing was stored" in reply.error and stored == ()
    assert not any(entry["event"] == "query_crashed" for entry in logs)


async def test_nats_not_answering_is_waited_out_beyond_the_crash_retries(
        private_nats: NatsServer) -> None:
    """With the lock bucket's stream gone (as while its leader is elected),
    the session cannot be taken: the query is tried again more often than a
    crash would be, and answered once the stream is back."""
    async with in_process_generator(private_nats.url, GeneratorSettings(model="stub-model"),
                                    Answering()) as rig:
        await rig.bus.js.delete_key_value(subjects.LOCKS_BUCKET)
        await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                 session_id=SID)
        await eventually(lambda: deliveries(rig.bus.js, MAX_CRASHES + 1),
                         "the query tried more often than a crash would be")
        assert rig.replies.empty()
        await ensure_layout(rig.bus.js)
        reply = await asyncio.wait_for(rig.replies.get(), 15)
        assert (reply.reply, reply.error_code) == ("an answer", None)


async def test_nats_not_answering_past_the_patience_is_told_as_nats_unavailable(
        private_nats: NatsServer) -> None:
    settings = GeneratorSettings(model="stub-model", nats_away_patience_s=0.5)
    async with in_process_generator(private_nats.url, settings, Answering()) as rig:
        await rig.bus.js.delete_stream(subjects.HISTORY_STREAM)
        await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                 session_id=SID)
        reply = await asyncio.wait_for(rig.replies.get(), 15)
        assert reply.error_code == "nats_unavailable"
        assert reply.error is not None and "NoStreamResponseError" in reply.error


async def test_an_answer_nats_does_not_take_at_once_is_stored_without_asking_again(
        private_nats: NatsServer) -> None:
    """The model has answered; the history stream is gone (its leader being
    elected): the write is tried again with the answer in hand, not the turn."""
    # Counted from the log: a subscriber on the subject would turn the
    # stream's absence into a publish that times out.
    with structlog.testing.capture_logs() as logs:
        async with in_process_generator(private_nats.url, GeneratorSettings(model="stub-model"),
                                        Answering()) as rig:
            await rig.bus.js.delete_stream(subjects.HISTORY_STREAM)
            await rig.bus.js_publish(subjects.query(SID), Query(session_id=SID, content="hi"),
                                     session_id=SID)
            await eventually(lambda: tried_again(logs) >= 3,
                             "the answer's write tried again three times")
            await ensure_layout(rig.bus.js)
            reply = await asyncio.wait_for(rig.replies.get(), 15)
            assert (reply.reply, reply.error_code) == ("an answer", None)
            assert rig.model.calls == 1
            stored = (await HistoryStore(rig.bus.js).read(SID)).conversation.messages
            assert [m.content for m in stored] == ["hi", "an answer"]


def tried_again(logs: list[MutableMapping[str, Any]]) -> int:
    return sum(entry["event"] == "history_write_tried_again" for entry in logs)


def test_a_failure_logged_names_the_function_of_ours_it_came_from() -> None:
    """`query_met_nats_away error=TimeoutError` alone could not say which of a
    turn's NATS calls went unanswered."""
    try:
        Policy(threshold=2.0)
    except ValueError as err:
        assert raised_in(err) == "decision.__post_init__"
    assert raised_in(ValueError("raised nowhere")) == "?"


async def test_a_failure_of_requests_sent_together_names_the_function_that_sent_them(
        nc: NATS) -> None:
    """The lock's create and look-up go out together (`services/shared/together.py`):
    a failure of either was logged `where=together.together`, which said nothing."""
    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket="gone_locks"))
    await js.delete_key_value("gone_locks")  # every request to it now fails at once
    locks = SessionLocks(kv, "crash-test", 5.0, 5.0)
    try:
        await locks.try_acquire("s1", "query")
    except Exception as err:  # which error NATS answers with does not matter here
        assert raised_in(err) == "session_lock._take_over"
    else:
        raise AssertionError("a lock taken in a bucket that is gone")
