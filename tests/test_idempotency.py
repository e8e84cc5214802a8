"""`Idempotency-Key`: a message sent again under the same key is answered
once, whether its first sending is answered already or still under way;
the key cannot be reused for another message; keys are the session's own.

The key's rules are pure and tested first; then real processes, with the
stand-in writing long answers slowly, so that a first sending can be held
under way (and stopped) for as long as a test needs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import pytest

from schemas import subjects
from schemas.history import ChatMessage, Conversation, HistoryEntry
from schemas.messages import Reply
from services.gateway.idempotency import (
    InvalidKey,
    KeyReused,
    earlier_outcome,
    kept_outcome,
    key_of,
    query_id_for,
    same_message,
)
from services.shared.query_errors import KeptError, digest
from tests import slow_answers
from tests.events import Watcher, server_sent_events, watching
from tests.nats_server import free_port
from tests.slow_answers import LONG, SSE, create
from tests.stub_server import stub_stats
from tests.system import System, gateway_client

# ----------------------------------------------------------------- the key's rules


@pytest.mark.parametrize("header, key", [
    (None, None),
    ("abc", "abc"),
    ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ("  k1  ", "k1"),
    ("x" * 255, "x" * 255),
])
def test_a_key_is_read_bare_or_quoted(header: str | None, key: str | None) -> None:
    assert key_of(header) == key


@pytest.mark.parametrize("header", ["", '""', "a b", "x" * 256, "clé", "tab\there"])
def test_a_malformed_key_is_refused(header: str) -> None:
    with pytest.raises(InvalidKey):
        key_of(header)


def test_the_query_id_is_the_sessions_own_and_the_kinds_own() -> None:
    one = query_id_for("s1", "k", retry=False)
    assert one == query_id_for("s1", "k", retry=False)
    assert len(one) == 32 and int(one, 16) >= 0
    assert len({one, query_id_for("s2", "k", retry=False), query_id_for("s1", "k2", retry=False),
                query_id_for("s1", "k", retry=True)}) == 4


def _turn(query_id: str, question: str, answer: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage(role="user", content=question, query_id=query_id),
            ChatMessage(role="assistant", content=answer, query_id=query_id))


def test_an_answered_query_is_answered_from_the_history() -> None:
    conversation = Conversation(messages=_turn("q1", "hi", "hello"))
    earlier = earlier_outcome(conversation, "s", "q1", "hi")
    assert earlier is not None and earlier.reply == "hello" and earlier.query_id == "q1"
    assert earlier_outcome(conversation, "s", "q2", "hi") is None


def test_a_question_stored_but_not_answered_is_still_to_be_answered() -> None:
    asked = Conversation(messages=_turn("q1", "hi", "hello")[:1])
    assert earlier_outcome(asked, "s", "q1", "hi") is None


def test_a_key_sent_with_another_message_is_refused() -> None:
    conversation = Conversation(messages=_turn("q1", "hi", "hello"))
    with pytest.raises(KeyReused):
        earlier_outcome(conversation, "s", "q1", "something else")


def test_a_resend_is_compared_with_the_first_sending_when_that_could_be_read() -> None:
    same_message("hi", "hi")
    same_message(None, "anything")  # a first sending unknown, or not read as a query
    with pytest.raises(KeyReused):
        same_message("hi", "something else")


def test_a_kept_error_is_the_outcome_only_of_the_message_it_answered() -> None:
    error = Reply(session_id="s", query_id="q1", error_code="timeout", error="too slow")
    kept = KeptError(reply=error, question_digest=digest("hi"))
    assert kept_outcome(kept, "hi") == error and kept_outcome(None, "hi") is None
    with pytest.raises(KeyReused):
        kept_outcome(kept, "something else")
    assert kept_outcome(KeptError(reply=error), "anything") == error  # kept without a digest


def test_a_turn_folded_into_the_summary_is_said_to_be_answered() -> None:
    folded = Conversation(summary="they greeted", compacted_query_ids=("q1",))
    earlier = earlier_outcome(folded, "s", "q1", "hi")
    assert earlier is not None and earlier.error_code == "already_answered"


def test_a_message_whose_answer_a_retry_replaced_gets_the_answer_standing_now() -> None:
    answered = Conversation(messages=_turn("q1", "hi", "hello"))
    again = ChatMessage(role="assistant", content="hello again", query_id="r1")
    retried = answered.apply(HistoryEntry.of_turn((again,), supersedes="q1"))
    earlier = earlier_outcome(retried, "s", "q1", "hi")
    assert earlier is not None and (earlier.reply, earlier.query_id) == ("hello again", "q1")
    retry = earlier_outcome(retried, "s", "r1", "hi")
    assert retry is not None and retry.reply == "hello again"


def test_a_retry_whose_answer_a_later_retry_replaced_is_said_to_be_answered() -> None:
    answered = Conversation(messages=_turn("q1", "hi", "hello"))
    for retry, supersedes in (("r1", "q1"), ("r2", "r1")):
        again = ChatMessage(role="assistant", content=f"from {retry}", query_id=retry)
        answered = answered.apply(HistoryEntry.of_turn((again,), supersedes=supersedes))
    earlier = earlier_outcome(answered, "s", "r1", "hi")
    assert earlier is not None and earlier.error_code == "already_answered"
    assert "retry" in (earlier.error or "")


# ------------------------------------------------------------------ real processes


# The slow system's fixtures, by their names in this module.
stub, system, http = slow_answers.stub, slow_answers.system, slow_answers.http


async def say(http: httpx.AsyncClient, sid: str, content: str, key: str,
              **headers: str) -> httpx.Response:
    return await http.post(f"/api/sessions/{sid}/messages", json={"content": content},
                           headers={"Idempotency-Key": key, **headers})


async def context(http: httpx.AsyncClient, sid: str) -> list[dict[str, object]]:
    return list((await http.get(f"/api/sessions/{sid}")).json()["messages"])


async def test_a_resend_after_the_answer_gets_the_same_answer_without_a_model_call(
    http: httpx.AsyncClient, stub: str,
) -> None:
    sid = await create(http)
    first = await say(http, sid, "hello", "key-1")
    assert first.status_code == 200, first.text
    calls = (await stub_stats(stub))["requests"]
    again = await say(http, sid, "hello", "key-1")
    streamed = await say(http, sid, "hello", "key-1", **SSE)
    assert again.status_code == 200, again.text
    assert again.json()["reply"] == first.json()["reply"]
    counts = ("prompt_tokens", "completion_tokens")
    assert all(isinstance(first.json()[name], int) for name in counts)
    assert {n: again.json()[n] for n in counts} == {n: first.json()[n] for n in counts}
    events = [event async for event in server_sent_events(streamed)]
    assert events[-1][0] == "done" and events[-1][1]["reply"] == first.json()["reply"]
    assert (await stub_stats(stub))["requests"] == calls
    assert [m["role"] for m in await context(http, sid)] == ["user", "assistant"]


async def test_a_resend_while_the_first_is_answered_waits_for_that_answer(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    sid = await create(http)
    async with watching(nats_url, subjects.query(sid)) as queries, \
            http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": LONG},
                        headers={"Idempotency-Key": "long-1", **SSE}) as first:
        events = server_sent_events(first)
        assert (await anext(events))[0] == "token"  # the answer is under way
        again = asyncio.create_task(say(http, sid, LONG, "long-1"))
        # Both sendings are published; the QUERIES stream keeps one.
        await queries.wait_until(lambda: len(queries.payloads()) == 2)
        stop = await http.post(f"/api/sessions/{sid}/stop")
        assert stop.status_code == 202, stop.text
        done = [data async for name, data in events if name == "done"]
    resent = await again
    assert resent.status_code == 200, resent.text
    assert resent.json()["stopped"] is True
    assert resent.json()["reply"] == done[0]["reply"]
    assert [m["role"] for m in await context(http, sid)] == ["user", "assistant"]


async def test_a_key_reused_for_another_message_is_refused_and_nothing_is_stored(
    http: httpx.AsyncClient,
) -> None:
    sid = await create(http)
    assert (await say(http, sid, "hello", "key-2")).status_code == 200
    reused = await say(http, sid, "another thing", "key-2")
    assert reused.status_code == 422, reused.text
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert [m["content"] for m in await context(http, sid)] == ["hello", "Echo: hello (turn 1)"]


async def test_a_key_reused_while_its_first_message_waits_is_refused(
    http: httpx.AsyncClient,
) -> None:
    sid = await create(http)
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": LONG},
                           headers={"Idempotency-Key": "long-2", **SSE}) as first:
        events = server_sent_events(first)
        assert (await anext(events))[0] == "token"  # the first is being answered
        reused = await say(http, sid, "another thing", "long-2")
        assert (await http.post(f"/api/sessions/{sid}/stop")).status_code == 202
        assert [name async for name, _ in events][-1] == "done"
    assert reused.status_code == 422, reused.text
    assert reused.json()["error"]["code"] == "idempotency_key_reused"
    assert [m["role"] for m in await context(http, sid)] == ["user", "assistant"]


async def test_a_malformed_key_is_a_400_and_nothing_is_sent(http: httpx.AsyncClient) -> None:
    sid = await create(http)
    refused = await say(http, sid, "hello", "has a space")
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_idempotency_key"
    assert await context(http, sid) == []


async def test_the_same_key_in_two_sessions_is_two_messages(http: httpx.AsyncClient) -> None:
    one, two = await create(http), await create(http)
    first, second = await say(http, one, "hello", "shared"), await say(http, two, "hi", "shared")
    assert first.status_code == second.status_code == 200
    assert first.json()["reply"] != second.json()["reply"]
    assert len(await context(http, two)) == 2


async def test_a_retry_resent_under_its_key_is_one_retry(
    http: httpx.AsyncClient, stub: str,
) -> None:
    sid = await create(http)
    assert (await say(http, sid, "hello", "q")).status_code == 200
    retry = {"Idempotency-Key": "retry-1"}
    first = await http.post(f"/api/sessions/{sid}/retry", headers=retry)
    assert first.status_code == 200, first.text
    calls = (await stub_stats(stub))["requests"]
    again = await http.post(f"/api/sessions/{sid}/retry", headers=retry)
    assert again.status_code == 200, again.text
    assert again.json()["reply"] == first.json()["reply"]
    assert (await stub_stats(stub))["requests"] == calls


async def test_resends_after_retries_replaced_their_answers_ask_the_model_nothing(
    http: httpx.AsyncClient, stub: str,
) -> None:
    sid = await create(http)
    assert (await say(http, sid, "hello", "q")).status_code == 200
    first_retry = await http.post(f"/api/sessions/{sid}/retry",
                                  headers={"Idempotency-Key": "retry-1"})
    second_retry = await http.post(f"/api/sessions/{sid}/retry",
                                   headers={"Idempotency-Key": "retry-2"})
    assert first_retry.status_code == second_retry.status_code == 200, second_retry.text
    calls = (await stub_stats(stub))["requests"]
    message = await say(http, sid, "hello", "q")
    assert message.status_code == 200, message.text
    assert message.json()["reply"] == second_retry.json()["reply"]
    retry = await http.post(f"/api/sessions/{sid}/retry", headers={"Idempotency-Key": "retry-1"})
    assert retry.status_code == 409 and retry.json()["error"]["code"] == "already_answered"
    assert (await stub_stats(stub))["requests"] == calls
    session = (await http.get(f"/api/sessions/{sid}")).json()
    assert [m["content"] for m in session["messages"] if m["role"] == "user"] == ["hello"]


async def failed_once(http: httpx.AsyncClient, key: str) -> tuple[str, httpx.Response]:
    """A session on a model the stand-in lacks, and its first message's error."""
    created = await http.post("/api/sessions", json={"model": "no-such-model"})
    sid = str(created.json()["session_id"])
    first = await say(http, sid, "hello", key)
    assert first.status_code == 404 and first.json()["error"]["code"] == "model_not_found"
    return sid, first


async def test_a_resend_after_an_error_reply_gets_that_error_without_a_new_try(
    http: httpx.AsyncClient, stub: str,
) -> None:
    sid, first = await failed_once(http, "fails")
    calls = (await stub_stats(stub))["requests"]
    again = await say(http, sid, "hello", "fails")
    assert again.status_code == 404, again.text
    assert again.json() == first.json()
    assert (await stub_stats(stub))["requests"] == calls


async def test_a_gateway_started_since_the_error_reply_tells_that_error(
    http: httpx.AsyncClient, system: System,
) -> None:
    sid, first = await failed_once(http, "missed")
    port = free_port()
    late = system.add("late gateway", "services.gateway", {"GATEWAY_PORT": str(port)})
    late.start()
    try:
        async with gateway_client(f"http://127.0.0.1:{port}") as other:
            again = await say(other, sid, "hello", "missed")
    finally:
        late.stop()
    assert again.status_code == 404, again.text
    assert again.json() == first.json()


async def test_a_key_reused_for_another_message_after_an_error_is_refused(
    http: httpx.AsyncClient,
) -> None:
    sid, first = await failed_once(http, "errored-then-reused")
    other = await say(http, sid, "something else", "errored-then-reused")
    assert other.status_code == 422, other.text
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    again = await say(http, sid, "hello", "errored-then-reused")  # the same message: its error
    assert (again.status_code, again.json()) == (first.status_code, first.json())


async def test_an_error_no_longer_kept_is_failed_before_rather_than_a_wait(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    sid, _ = await failed_once(http, "gone")
    nc = await nats.connect(nats_url)
    try:  # as when its keeping ran out, or NATS did not take it
        kept = await nc.jetstream().key_value(subjects.QUERY_ERRORS_BUCKET)
        await kept.purge(query_id_for(sid, "gone", retry=False))
    finally:
        await nc.close()
    again = await say(http, sid, "hello", "gone")
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "failed_before"


async def stopped_once(http: httpx.AsyncClient) -> str:
    """A new session whose one answer was stopped while written: one to retry."""
    sid = await create(http)
    async with http.stream("POST", f"/api/sessions/{sid}/messages", json={"content": LONG},
                           headers=SSE) as first:
        events = server_sent_events(first)
        assert (await anext(events))[0] == "token"
        assert (await http.post(f"/api/sessions/{sid}/stop")).status_code == 202
        assert [name async for name, _ in events][-1] == "done"
    return sid


@contextlib.asynccontextmanager
async def retry_under_way(http: httpx.AsyncClient, nats_url: str, sid: str,
                          headers: dict[str, str]
                          ) -> AsyncIterator[tuple[Watcher, AsyncIterator[tuple[str, Any]]]]:
    """A retry streamed under `headers`, its first token already come, and
    the session's queries watched from before it was sent."""
    url = f"/api/sessions/{sid}/retry"
    async with watching(nats_url, subjects.query(sid)) as queries, \
            http.stream("POST", url, headers={**headers, **SSE}) as running:
        events = server_sent_events(running)
        assert (await anext(events))[0] == "token"  # the retried answer is under way
        yield queries, events


async def test_a_retry_resent_while_it_runs_waits_for_that_answer(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    sid = await stopped_once(http)
    retry = {"Idempotency-Key": "long-retry"}
    async with retry_under_way(http, nats_url, sid, retry) as (queries, events):
        again = asyncio.create_task(http.post(f"/api/sessions/{sid}/retry", headers=retry))
        await queries.wait_until(lambda: len(queries.payloads()) == 2)
        assert (await http.post(f"/api/sessions/{sid}/stop")).status_code == 202
        done = [data async for name, data in events if name == "done"]
    resent = await again
    assert resent.status_code == 200, resent.text
    assert resent.json()["reply"] == done[0]["reply"] and resent.json()["stopped"] is True
    transcript = (await http.get(f"/api/sessions/{sid}/transcript")).json()["items"]
    assert [item["role"] for item in transcript] == ["user", "assistant", "assistant"]


async def test_a_retry_resent_with_a_message_queued_behind_it_waits_for_its_answer(
    http: httpx.AsyncClient, nats_url: str,
) -> None:
    """Only a resend whose retry was the session's last queued query was known
    as its own: with a message queued after it, the resend (a dropped
    connection's "Send again") was refused as `turn_running`."""
    sid = await stopped_once(http)
    retry = {"Idempotency-Key": "retry-before-a-message"}
    async with retry_under_way(http, nats_url, sid, retry) as (queries, events):
        later = asyncio.create_task(say(http, sid, "and then this", "queued-behind"))
        await queries.wait_until(lambda: len(queries.payloads()) == 2)
        again = asyncio.create_task(http.post(f"/api/sessions/{sid}/retry", headers=retry))
        await queries.wait_until(lambda: len(queries.payloads()) == 3)
        assert (await http.post(f"/api/sessions/{sid}/stop")).status_code == 202
        done = [data async for name, data in events if name == "done"]
    resent = await again
    assert resent.status_code == 200, resent.text
    assert resent.json()["reply"] == done[0]["reply"]
    assert (await later).status_code == 200
