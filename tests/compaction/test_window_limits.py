"""The window on real processes: no prompt, answer or tool result ever
overflows it, and what cannot fit is refused with the history untouched
(`conftest.py` here starts the system they run on)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.compaction.rig import (
    EVENTS,
    NUM_CTX,
    SMALL_WINDOW,
    chat,
    create,
    next_result,
    serve_a_verbose_tool,
    session,
)
from tests.events import decider_caught_up, watching
from tests.nats_server import NatsServer
from tests.stub_server import configure_stub, stub_stats


@pytest.mark.parametrize("env, body", [
    ({"COMPACTION_THRESHOLD": "0"}, {}),
    ({}, {"auto_compact": False}),
])
async def test_without_automatic_compaction_an_oversized_prompt_is_refused(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient],
    env: dict[str, str], body: dict[str, object]
) -> None:
    http = start(**env)
    sid = await create(http, **body)
    async with watching(private_nats.url, *EVENTS) as watcher:
        replies = await chat(http, sid, 12, filler=600)
        # The decider has judged every report.
        await decider_caught_up(private_nats.url)
    refused = [r for r in replies if r.status_code != 200]
    assert refused, "the window never filled"
    assert refused[0].status_code == 413
    assert refused[0].json()["error"]["code"] == "context_overflow"
    assert "compact" in refused[0].json()["error"]["message"]
    assert not watcher.payloads("compaction.request")
    assert not watcher.payloads("compaction.event")
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX and stats["truncated"] == 0
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        assert (await next_result(watcher, sid))["status"] == "completed"
    assert (await chat(http, sid, 1, filler=10, start=50))[0].status_code == 200


async def test_a_message_larger_than_the_window_is_refused_before_sending(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    http = start()
    sid = await create(http)
    await chat(http, sid, 2)
    sent_before = (await stub_stats(stub))["requests"]
    huge = await http.post(f"/api/sessions/{sid}/messages", json={"content": "x" * 20_000})
    assert huge.status_code == 413
    assert huge.json()["error"]["code"] == "context_overflow"
    stats = await stub_stats(stub)
    # No model call with the huge message; at most the emergency summariser ran.
    assert stats["max_prompt_tokens"] <= NUM_CTX
    assert stats["requests"] - sent_before <= 1
    assert all(m["content"] != "x" * 20_000 for m in (await session(http, sid))["messages"])


async def test_after_an_oversized_message_long_turns_never_overflow_any_call(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """One message larger than the window, then 25 turns of about 1,200
    characters: every call the stand-in receives fits, the summariser's too."""
    http = start()
    sid = await create(http)
    huge = await http.post(f"/api/sessions/{sid}/messages", json={"content": "x" * 20_000})
    assert huge.status_code == 413
    async with watching(private_nats.url, *EVENTS) as watcher:
        replies = [await http.post(f"/api/sessions/{sid}/messages",
                                   json={"content": f"question {i} " + "w" * 1200})
                   for i in range(25)]
        await decider_caught_up(private_nats.url)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    levels = {p["level"] for p in watcher.payloads("compaction.event")}
    assert "emergency" in levels, levels
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX - 256 and stats["truncated"] == 0


async def test_a_prompt_the_model_counts_longer_than_its_window_is_never_cut(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """The model's tokenizer counts four times what the session's rate says
    (a new model, say). The estimate finds the next prompt fits; sent without
    truncation, it is refused, the rates rise to the window it exceeds, and
    the turn is fitted again. Before, Ollama cut it silently (old messages,
    on some releases the system prompt) and answered what was left."""
    http = start(services=("generator", "gateway"))
    sid = await create(http)
    assert all(r.status_code == 200 for r in await chat(http, sid, 3, filler=1200))
    await configure_stub(stub, chars_per_token=1.0)
    reply = await http.post(f"/api/sessions/{sid}/messages",
                            json={"content": "question 4 !long 20"})
    assert reply.status_code == 200, reply.text  # after a compaction whose pieces learnt too
    assert reply.json()["reply"].startswith("Echo: question 4")
    stats = await stub_stats(stub)
    assert stats["truncated"] == 0 and stats["refused_too_long"] >= 1
    assert (await session(http, sid))["compactions"] == 1


async def test_an_answer_never_writes_past_the_window(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """A model that writes on and on: unbounded, Ollama lets it write ten
    windows' worth, dropping the start of the prompt (the system prompt) to
    make room. The answer gets what the prompt leaves of the window."""
    http = start(services=("generator", "gateway"))
    sid = await create(http)
    reply = await http.post(f"/api/sessions/{sid}/messages",
                            json={"content": "tell me everything !long 20000"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["prompt_tokens"] + body["completion_tokens"] <= NUM_CTX


async def test_a_session_goes_on_after_an_answer_that_wrote_all_it_could(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """An answer that filled what its prompt left of the window made a last
    turn larger than the budget: kept raw by every compaction, it left each
    later message refused as too long, a manual compaction skipped, and a
    retry wrote it again. Its turn now keeps room for the next question."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http)
    await chat(http, sid, 3, filler=10)
    long = await http.post(f"/api/sessions/{sid}/messages",
                           json={"content": "tell me everything !long 100000"})
    assert long.status_code == 200, long.text
    retried = await http.post(f"/api/sessions/{sid}/retry")
    assert retried.status_code == 200, retried.text
    for content in ("and now?", "thanks"):
        reply = await http.post(f"/api/sessions/{sid}/messages", json={"content": content})
        assert reply.status_code == 200, reply.text


async def test_a_session_goes_on_after_a_question_near_the_budget(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """A question of some 80 % of the budget, answered: as the last turn, kept
    raw by an emergency compaction, it left no room for any next message,
    each refused as one no compaction could make room for. The turn after it
    now has everything summarised, that turn too; the transcript keeps all."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http)
    await chat(http, sid, 2, filler=10)
    question = "y " * 2900 + "!long 5000"  # and an answer as long as it may be
    large = await http.post(f"/api/sessions/{sid}/messages", json={"content": question})
    assert large.status_code == 200, large.text
    after = await http.post(f"/api/sessions/{sid}/messages", json={"content": "and now?"})
    assert after.status_code == 200, after.text
    context = await session(http, sid)
    assert context["compactions"] == 1
    assert context["messages"][0]["content"] == "and now?"
    said = (await http.get(f"/api/sessions/{sid}/transcript")).json()["items"]
    assert question in [item.get("content") for item in said]


async def test_a_summary_larger_than_the_minimal_one_does_not_refuse_the_message(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """The emergency compaction keeps the last turn when a minimal summary
    would leave room; the summary written was larger (here, larger than what
    it replaced, so it was not kept), and the message was refused. The last
    turn is then summarised too."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http)
    for content in ("first !summary 1200 " + "w " * 400, "y " * 1000):
        assert (await http.post(f"/api/sessions/{sid}/messages",
                                json={"content": content})).status_code == 200
    asked = await http.post(f"/api/sessions/{sid}/messages", json={"content": "z " * 2100})
    assert asked.status_code == 200, asked.text
    context = await session(http, sid)
    assert context["compactions"] == 1 and context["messages"][0]["content"] == "z " * 2100


async def test_a_paste_no_compaction_could_fit_is_refused_with_the_history_untouched(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    """30,000 characters (7,500 tokens against a limit of 6,809): no emergency
    compaction, no model call, 413 at once."""
    http = start(NUM_CTX="8192", COMPACTION_THRESHOLD="0.95")
    sid = await create(http)
    await chat(http, sid, 4, filler=2000)
    before = await session(http, sid)
    sent_before = (await stub_stats(stub))["requests"]
    async with watching(private_nats.url, *EVENTS) as watcher:
        paste = await http.post(f"/api/sessions/{sid}/messages", json={"content": "x" * 30_000})
        await chat(http, sid, 1, filler=10, start=9)  # events of the paste are out by now
    assert paste.status_code == 413, paste.text
    assert "no compaction could make room" in paste.json()["error"]["message"]
    assert not watcher.payloads("compaction.event")
    assert (await stub_stats(stub))["requests"] == sent_before + 1  # the next turn's only
    after = await session(http, sid)
    assert after["compactions"] == 0 and after["messages"][:-2] == before["messages"]


async def test_a_tool_result_larger_than_the_window_is_cut_and_the_turn_answered(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient]
) -> None:
    tools = await serve_a_verbose_tool(private_nats.url, "#start " + "o" * 60_000)
    try:
        http = start()
        sid = await create(http)
        await chat(http, sid, 2, filler=50)
        reply = await http.post(f"/api/sessions/{sid}/messages", json={"content": "!tool dump"})
        # Cut to leave room: the session goes on (its last turn is kept raw).
        following = await chat(http, sid, 2, filler=300, start=5)
    finally:
        await tools.drain()
    assert reply.status_code == 200, reply.text
    assert all(r.status_code == 200 for r in following), [r.text for r in following]
    stored = [m for m in (await session(http, sid))["messages"] if m["role"] == "tool"]
    assert stored[0]["content"].startswith("#start ooo")
    assert "characters left out here: too long to send whole" in stored[0]["content"]
    stats = await stub_stats(stub)
    assert stats["max_prompt_tokens"] <= NUM_CTX - 256 and stats["truncated"] == 0


@pytest.mark.parametrize("turns_before", [0, 1])
async def test_with_automatic_compaction_off_a_compaction_asked_for_frees_a_full_session(
    private_nats: NatsServer, stub: str, start: Callable[..., httpx.AsyncClient],
    turns_before: int,
) -> None:
    """Automatic compaction off, one answer that wrote all it could: every
    message after it was refused with the advice to compact, and that
    compaction was skipped, the whole history being within the raw tail.
    Asked for by a person on a context past the emergency line, it now keeps
    fewer turns raw, down to none."""
    http = start(services=("generator", "gateway"), **SMALL_WINDOW)
    sid = await create(http, auto_compact=False)
    await chat(http, sid, turns_before, filler=10)  # kept raw, it would leave the long one too
    long = await http.post(f"/api/sessions/{sid}/messages",
                           json={"content": "tell me everything !long 100000"})
    assert long.status_code == 200, long.text
    refused = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hi"})
    assert refused.status_code == 413, refused.text
    async with watching(private_nats.url, *EVENTS) as watcher:
        await http.post(f"/api/sessions/{sid}/compact")
        result = await next_result(watcher, sid)
    assert result["status"] == "completed", result
    answered = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hi"})
    assert answered.status_code == 200, answered.text
    said = (await http.get(f"/api/sessions/{sid}/transcript")).json()["items"]
    assert [item["role"] for item in said if item.get("role")][:2] == ["user", "assistant"]
