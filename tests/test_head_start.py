"""The head start: a turn's first model call sent before its lock is won.

The rule that decides whether a head start may be kept is pure and tested on
its own; the rest runs on real processes: a kept head start answers as an
ordinary turn would (streamed tokens included), and one whose session is
held elsewhere is thrown away unseen, the answer then built on the history
as it stands once the lock is ours."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import nats
import pytest

from schemas import subjects
from schemas.history import ChatMessage, Conversation
from schemas.session import SessionRecord
from scripts.benchmarks.throughput import generator_statuses
from services.core.text_size import Size
from services.generator.head_start import HeadStart, HeadStartCount, still_good
from services.generator.provider import ChatResult
from services.generator.service import QUERY_CONSUMER
from services.generator.session_lock import SessionLocks
from services.generator.turn import WeighedPrompt
from services.shared.history_store import HistoryStore, HistoryView
from services.shared.jetstream import locks_bucket
from tests.events import Watcher, eventually, server_sent_events, watching
from tests.nats_server import NatsServer
from tests.stub_server import running_stub
from tests.system import System
from tests.test_session_state import no_pull_request_standing

LEASE_S = 2.0  # the System's LOCK_LEASE_S


def view(last_seq: int) -> HistoryView:
    return HistoryView(Conversation(), last_seq)


RECORD = SessionRecord(session_id="s1", system="be brief")


def always_fits() -> bool:
    return True


def never_fits() -> bool:
    return False


# --------------------------------------------------------------------- the rule


def test_a_head_start_on_the_history_the_turn_reads_is_kept() -> None:
    assert still_good(view(7), RECORD, view(7), RECORD, never_fits)


def test_a_head_start_is_dropped_once_the_history_moved() -> None:
    assert not still_good(view(7), RECORD, view(9), RECORD, always_fits)


def test_a_recalibrated_record_keeps_the_head_start_if_the_prompt_still_fits() -> None:
    recalibrated = RECORD.model_copy(update={"tokens_per_char": 0.3})
    assert still_good(view(7), RECORD, view(7), recalibrated, always_fits)
    assert not still_good(view(7), RECORD, view(7), recalibrated, never_fits)


@pytest.mark.parametrize("change", [{"system": "be verbose"}, {"model": "another:7b"}])
def test_a_record_that_changes_the_prompt_drops_the_head_start(change: dict[str, str]) -> None:
    assert not still_good(view(7), RECORD, view(7), RECORD.model_copy(update=change),
                          always_fits)


# --------------------------------------------------------------- keep or abandon


def head_start_on(call: asyncio.Task[ChatResult], count: HeadStartCount) -> HeadStart:
    return HeadStart(view(1), RECORD, WeighedPrompt([], Size()), [], None, call, count)


async def test_a_kept_head_start_counts_once_and_is_not_cancelled_afterwards() -> None:
    count = HeadStartCount()
    head = head_start_on(asyncio.create_task(answer_soon("hi")), count)
    assert (await head.result()).content == "hi"
    head.abandon()  # what every turn does on its way out
    assert (count.kept, count.abandoned) == (1, 0)


async def test_an_abandoned_head_start_cancels_its_call() -> None:
    count = HeadStartCount()
    call = asyncio.create_task(asyncio.sleep(30, ChatResult(content="never")))
    head = head_start_on(call, count)
    head.abandon()
    head.abandon()
    await asyncio.sleep(0)
    assert call.cancelled()
    assert (count.kept, count.abandoned) == (0, 1)


async def test_an_abandoned_head_start_whose_call_failed_leaves_no_stray_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    call = asyncio.create_task(fail_soon())
    await asyncio.sleep(0.01)
    head = head_start_on(call, HeadStartCount())
    head.abandon()
    del head, call
    await asyncio.sleep(0)
    assert "exception was never retrieved" not in caplog.text


async def answer_soon(text: str) -> ChatResult:
    await asyncio.sleep(0.01)
    return ChatResult(content=text)


async def fail_soon() -> ChatResult:
    raise RuntimeError("the model is away")


# ------------------------------------------------------------- real processes


@pytest.fixture
def stub() -> Iterator[str]:
    """A stand-in that streams word by word, a few milliseconds apart."""
    with running_stub() as url:
        httpx.post(f"{url}/_stub/config", json={"ms_per_token": 5}).raise_for_status()
        yield url


@pytest.fixture
def system(private_nats: NatsServer, stub: str) -> Iterator[System]:
    system = System(private_nats.url, stub, services=("generator", "gateway", "tools"))
    yield system.start()
    system.stop()


@pytest.fixture
async def http(system: System) -> AsyncIterator[httpx.AsyncClient]:
    async with system.http(timeout=30) as client:
        yield client


async def all_head_starts(nats_url: str, generators: int) -> dict[str, dict[str, int]]:
    nc = await nats.connect(nats_url)
    try:
        statuses = await generator_statuses(nc, generators)
        return {generator: status["head_starts"] for generator, status in statuses.items()}
    finally:
        await nc.close()


async def head_starts(nats_url: str) -> dict[str, int]:
    """The counts of the one generator running."""
    (counts,) = (await all_head_starts(nats_url, 1)).values()
    return counts


async def streamed(http: httpx.AsyncClient, sid: str, content: str
                   ) -> list[tuple[str, dict[str, Any]]]:
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": content},
                           headers={"Accept": "text/event-stream"}) as response:
        return [event async for event in server_sent_events(response)]


def tokens_and_reply(events: list[tuple[str, dict[str, Any]]]) -> tuple[str, str]:
    names = [name for name, _ in events]
    assert names[-1] == "done" and set(names[:-1]) <= {"token"}, names
    indexes = [int(data["index"]) for name, data in events if name == "token"]
    assert indexes == list(range(len(indexes)))
    text = "".join(str(data["text"]) for name, data in events if name == "token")
    return text, str(events[-1][1]["reply"])


async def messages_of(http: httpx.AsyncClient, sid: str) -> list[tuple[str, str]]:
    body = (await http.get(f"/api/sessions/{sid}")).json()
    return [(m["role"], m.get("content", "")) for m in body["messages"]]


async def test_a_session_this_generator_answered_last_starts_its_next_answer_early(
    system: System, http: httpx.AsyncClient, stub: str, private_nats: NatsServer,
) -> None:
    sid = str((await http.post("/api/sessions", json={})).json()["session_id"])
    first = await http.post(f"/api/sessions/{sid}/messages", json={"content": "one"})
    assert first.json()["reply"] == "Echo: one (turn 1)"
    assert await head_starts(private_nats.url) == {"kept": 0, "abandoned": 0}

    text, reply = tokens_and_reply(await streamed(http, sid, "two, streamed"))
    assert text == reply == "Echo: two, streamed (turn 2)"
    tool = await http.post(f"/api/sessions/{sid}/messages",
                           json={"content": '!tool word_count {"text": "a b"}'})
    assert tool.json()["reply"] == "tool results: 2 words, 1 lines, 3 characters"

    assert await head_starts(private_nats.url) == {"kept": 2, "abandoned": 0}
    assert [role for role, _ in await messages_of(http, sid)] == [
        "user", "assistant", "user", "assistant", "user", "assistant", "tool", "assistant"]


async def test_a_head_start_for_a_session_held_elsewhere_is_dropped_unseen(
    system: System, http: httpx.AsyncClient, stub: str, private_nats: NatsServer,
) -> None:
    sid = str((await http.post("/api/sessions", json={})).json()["session_id"])
    await http.post(f"/api/sessions/{sid}/messages", json={"content": "one"})
    nc = await nats.connect(private_nats.url)
    elsewhere = SessionLocks(await locks_bucket(nc.jetstream(), LEASE_S), "elsewhere",
                             LEASE_S, wait_s=5)
    try:
        async with elsewhere.hold(sid, "query"):
            asking = asyncio.create_task(streamed(http, sid, "two"))
            async def given_up() -> bool:
                return bool((await head_starts(private_nats.url))["abandoned"])

            await eventually(given_up, "the generator gave its head start up")
            # Meanwhile the holder answers a query of its own.
            store = HistoryStore(nc.jetstream())
            await store.append(sid, await store.read(sid), [
                ChatMessage(role="user", content="meanwhile", query_id="q-elsewhere"),
                ChatMessage(role="assistant", content="noted", query_id="q-elsewhere")])
        text, reply = tokens_and_reply(await asking)
    finally:
        await nc.close()

    assert text == reply == "Echo: two (turn 3)"  # saw the holder's turn
    assert await head_starts(private_nats.url) == {"kept": 0, "abandoned": 1}
    assert await messages_of(http, sid) == [
        ("user", "one"), ("assistant", "Echo: one (turn 1)"),
        ("user", "meanwhile"), ("assistant", "noted"),
        ("user", "two"), ("assistant", "Echo: two (turn 3)")]


def returns(watcher: Watcher, sid: str) -> int:
    """Turns a generator took back after the other had answered the session."""
    seen: list[str] = []
    taken_back = 0
    for event in watcher.payloads("generator.state"):
        if event["session_id"] == sid and event["action"] == "start_generation":
            who = event["generator_id"]
            taken_back += bool(seen) and seen[-1] != who and who in seen
            seen.append(who)
    return taken_back


async def test_a_session_back_on_a_generator_finds_its_history_current(
    private_nats: NatsServer, stub: str,
) -> None:
    """Each generator follows the history, so after the other one answered a
    session its view already holds that turn: its head start is kept.

    The session is sent from one generator to the other and back by freezing
    the one that is not to answer (once its pull requests have ended, no
    query can reach it), so the return is forced, not left to chance."""
    system = System(private_nats.url, stub, services=("gateway",)).start()
    gen_a = system.add("gen-a", "services.generator", {"GENERATOR_ID": "gen-a"}).start()
    try:
        async with (system.http(timeout=30) as http,
                    watching(private_nats.url, f"{subjects.STATE_PREFIX}.*") as watcher):
            sid = str((await http.post("/api/sessions", json={})).json()["session_id"])

            async def ask(turn: int) -> None:
                answer = await http.post(f"/api/sessions/{sid}/messages",
                                         json={"content": f"q{turn}"})
                assert answer.json()["reply"] == f"Echo: q{turn} (turn {turn})"

            await ask(1)  # on gen-a
            gen_a.signal(signal.SIGSTOP)
            await no_pull_request_standing(private_nats.url, subjects.QUERIES_STREAM,
                                           QUERY_CONSUMER)
            gen_b = system.add("gen-b", "services.generator", {"GENERATOR_ID": "gen-b"}).start()
            await ask(2)  # on gen-b, the only one taking queries
            assert await asyncio.to_thread(gen_b.stop) == 0
            await no_pull_request_standing(private_nats.url, subjects.QUERIES_STREAM,
                                           QUERY_CONSUMER)
            # gen-b's write reached gen-a while it was frozen; it reads that
            # before any query it asks for after it wakes.
            gen_a.signal(signal.SIGCONT)
            await ask(3)  # back on gen-a
            taken_back = returns(watcher, sid)
        counts = await all_head_starts(private_nats.url, 1)
    finally:
        system.stop()  # which wakes a frozen one first
    kept = sum(c["kept"] for c in counts.values())
    abandoned = sum(c["abandoned"] for c in counts.values())
    assert taken_back >= 1, "no session went back to a generator: nothing was shown"
    assert abandoned <= taken_back // 4, (counts, taken_back)
    assert kept >= taken_back
