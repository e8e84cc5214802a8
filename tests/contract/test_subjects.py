"""Each service honours its subjects, seen only from outside: raw NATS and
HTTP, no code of the services. Point it at any running system:

    pytest tests/contract --nats-url nats://host:4222 --gateway-url http://host:8080

What it checks: every message is a well-formed envelope of its subject's
payload; a `compaction.request` gets exactly one `compaction.result`; each
answer is followed by one `response.generation` with the pinned fields; and
bad input gets a structured error, never silence.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from schemas.envelope import Envelope
from schemas.registry import PAYLOADS
from services.shared.bus import round_trip
from tests.contract.conftest import Target
from tests.system import gateway_client

WAIT_S = 30.0
PAYLOAD_OF = {p.MESSAGE_TYPE: p for p in PAYLOADS}
PER_SESSION = ("chat.query.", "chat.reply.", "chat.token.", "generator.state.")
# The fields the decider and any other reader of `response.generation` rely on.
PINNED_GENERATION = {"session_id": str, "model": str, "prompt_tokens": (int, type(None)),
                     "completion_tokens": (int, type(None)), "sent_chars": int, "num_ctx": int}
Event = dict[str, Any]


class Tap:
    """Every message on the tapped subjects, parsed, with its subject."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Event]] = []
        self._arrived = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        self.seen.append((msg.subject, json.loads(msg.data)))
        self._arrived.set()

    def where(self, test: Callable[[str, Event], bool]) -> list[Event]:
        return [event for subject, event in self.seen if test(subject, event)]

    async def until(self, test: Callable[[str, Event], bool], count: int = 1) -> list[Event]:
        async with asyncio.timeout(WAIT_S):
            while len(found := self.where(test)) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return found


@asynccontextmanager
async def tapped(nats_url: str, *subjects: str) -> AsyncIterator[tuple[Tap, NATS]]:
    nc = await nats.connect(nats_url)
    tap = Tap()
    for subject in subjects:
        await nc.subscribe(subject, cb=tap.on_message)
    await round_trip(nc)
    try:
        yield tap, nc
    finally:
        await nc.close()


def envelope(subject: str, message_type: str, payload: Event, sid: str | None) -> bytes:
    """A message as any other implementation would write it: plain JSON."""
    return json.dumps({
        "message_id": uuid.uuid4().hex, "message_type": message_type, "subject": subject,
        "sender_id": "contract-test", "correlation_id": uuid.uuid4().hex, "session_id": sid,
        "timestamp": datetime.now(UTC).isoformat(), "schema_version": 1, "payload": payload,
    }).encode()


async def new_session(client: httpx.AsyncClient) -> str:
    response = await client.post("/api/sessions", json={"auto_compact": False})
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


async def ask(client: httpx.AsyncClient, sid: str, content: str) -> Event:
    response = await client.post(f"/api/sessions/{sid}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    body: Event = response.json()
    return body


def gateway(target: Target) -> httpx.AsyncClient:
    return gateway_client(target.gateway_url, timeout=WAIT_S)


def of_session(sid: str) -> Callable[[str, Event], bool]:
    return lambda subject, event: event.get("session_id") == sid


async def test_every_message_is_an_envelope_of_its_subjects_payload(target: Target) -> None:
    subjects = ("chat.>", "generator.state.>", "response.generation", "compaction.>")
    async with tapped(target.nats_url, *subjects) as (tap, _), gateway(target) as client:
        sid = await new_session(client)
        await ask(client, sid, "hello contract")
        await ask(client, sid, "and once more")
        compact = await client.post(f"/api/sessions/{sid}/compact")
        assert compact.status_code == 202, compact.text
        await tap.until(lambda s, e: s == "compaction.result" and e.get("session_id") == sid)
        await tap.until(lambda s, e: s == "response.generation" and e.get("session_id") == sid,
                        count=2)
    mine = [(s, e) for s, e in tap.seen if e.get("session_id") == sid]
    assert {s.rsplit(".", 1)[0] if s.startswith(PER_SESSION) else s for s, _ in mine} >= {
        "chat.query", "chat.reply", "generator.state", "response.generation",
        "compaction.request", "compaction.result"}
    for subject, event in mine:
        payload = PAYLOAD_OF[event["message_type"]]
        Envelope[payload].model_validate(event)  # type: ignore[valid-type]
        assert event["subject"] == subject
        assert event["sender_id"]
        if subject.startswith(PER_SESSION):
            assert subject.rsplit(".", 1)[1] == sid
        assert event["payload"].get("session_id", sid) == sid


async def test_a_compaction_request_gets_exactly_one_result(target: Target) -> None:
    async with tapped(target.nats_url, "compaction.result") as (tap, nc), \
            gateway(target) as client:
        sid = await new_session(client)
        for n in range(3):
            await ask(client, sid, f"turn {n} " * 30)
        js = nc.jetstream()
        first = envelope("compaction.request", "compaction.request",
                         {"session_id": sid, "auto": False, "reason": "contract"}, sid)
        await js.publish("compaction.request", first)
        first_id = json.loads(first)["correlation_id"]
        [result] = await tap.until(lambda s, e: e["correlation_id"] == first_id)
        assert result["payload"]["status"] in ("completed", "skipped", "failed")
        assert result["session_id"] == sid
        # A second request, handled after the first: had the first produced
        # a second result, it would be here by the time this one's is.
        second = envelope("compaction.request", "compaction.request",
                          {"session_id": sid, "auto": False, "reason": "contract"}, sid)
        await js.publish("compaction.request", second)
        second_id = json.loads(second)["correlation_id"]
        await tap.until(lambda s, e: e["correlation_id"] == second_id)
    assert len(tap.where(lambda s, e: e["correlation_id"] == first_id)) == 1


async def test_a_request_for_an_unknown_session_gets_a_failed_result(target: Target) -> None:
    sid = f"nosuch{uuid.uuid4().hex[:10]}"
    async with tapped(target.nats_url, "compaction.result") as (tap, nc):
        request = envelope("compaction.request", "compaction.request",
                           {"session_id": sid, "auto": False, "reason": "contract"}, sid)
        await nc.jetstream().publish("compaction.request", request)
        [result] = await tap.until(of_session(sid))
    assert result["payload"]["status"] == "failed"
    assert result["payload"]["error"]


async def test_each_answer_has_one_generation_report_with_the_pinned_fields(
        target: Target) -> None:
    async with tapped(target.nats_url, "response.generation") as (tap, _), \
            gateway(target) as client:
        sid = await new_session(client)
        replies = [await ask(client, sid, f"question {n}") for n in range(3)]
        reports = await tap.until(of_session(sid), count=3)
        # One more answer: its report comes after any duplicate of the others.
        await ask(client, sid, "the last question")
        await tap.until(of_session(sid), count=4)
    reports = tap.where(of_session(sid))
    assert len(reports) == 4
    for report, reply in zip(reports, replies, strict=False):
        payload = report["payload"]
        for field, kind in PINNED_GENERATION.items():
            assert isinstance(payload[field], kind), (field, payload)
        assert payload["prompt_tokens"] == reply["prompt_tokens"]
        assert payload["completion_tokens"] == reply["completion_tokens"]


async def test_a_malformed_tool_call_gets_a_structured_error_reply(target: Target) -> None:
    async with tapped(target.nats_url) as (_, nc):
        answer = await nc.request("tool.call.calculate", b"{not json", timeout=WAIT_S)
    reply = json.loads(answer.data)
    assert reply["message_type"] == "error"
    assert {"code", "message"} <= set(reply["payload"])


async def test_a_query_for_an_unknown_session_gets_an_error_reply(target: Target) -> None:
    sid = f"nosuch{uuid.uuid4().hex[:10]}"
    query = envelope(f"chat.query.{sid}", "chat.query",
                     {"session_id": sid, "content": "anyone there?"}, sid)
    async with tapped(target.nats_url, f"chat.reply.{sid}") as (tap, nc):
        await nc.jetstream().publish(f"chat.query.{sid}", query)
        [reply] = await tap.until(of_session(sid))
    assert reply["correlation_id"] == json.loads(query)["correlation_id"]
    assert reply["payload"]["error_code"] == "unknown_session"
    assert reply["payload"]["error"]


async def test_a_malformed_query_with_an_id_gets_an_error_reply(target: Target) -> None:
    """Its caller, waiting on the session's reply subject, waited out its timeout."""
    sid = f"s{uuid.uuid4().hex[:12]}"
    query = json.loads(envelope(f"chat.query.{sid}", "chat.query",
                                {"session_id": sid, "content": ""}, sid))  # empty: invalid
    async with tapped(target.nats_url, f"chat.reply.{sid}") as (tap, nc):
        await nc.jetstream().publish(f"chat.query.{sid}", json.dumps(query).encode())
        [reply] = await tap.until(of_session(sid))
    assert reply["payload"]["query_id"] == query["message_id"]
    assert reply["payload"]["error_code"] == "invalid_message"
    assert "payload.content" in reply["payload"]["error"]


async def test_a_query_timed_without_a_zone_is_answered(target: Target) -> None:
    """`datetime.utcnow().isoformat()` writes no zone: such a query passed
    validation, then crashed the generator, and its answer was never sent."""
    async with gateway(target) as client:
        sid = await new_session(client)
    query = json.loads(envelope(f"chat.query.{sid}", "chat.query",
                                {"session_id": sid, "content": "hello"}, sid))
    query["timestamp"] = "2026-01-01T00:00:00"
    async with tapped(target.nats_url, f"chat.reply.{sid}") as (tap, nc):
        await nc.jetstream().publish(f"chat.query.{sid}", json.dumps(query).encode())
        [reply] = await tap.until(of_session(sid))
    assert reply["correlation_id"] == query["correlation_id"]
    assert reply["payload"].get("error_code") is None, reply["payload"]


async def test_a_malformed_event_is_reported_on_system_error(target: Target) -> None:
    marker = uuid.uuid4().hex
    bad = json.dumps({"message_type": "response.generation", "marker": marker}).encode()
    async with tapped(target.nats_url, "system.error") as (tap, nc):
        await nc.jetstream().publish("response.generation", bad)
        report = (await tap.until(lambda s, e: e.get("payload", {}).get("subject")
                                   == "response.generation"))[0]
    assert {"code", "message"} <= set(report["payload"])
    assert report["payload"]["subject"] == "response.generation"


async def test_a_query_naming_another_session_than_its_subject_is_refused(
        target: Target) -> None:
    """One on `chat.query.A` for B wrote a turn into B, past B's own queue."""
    async with gateway(target) as client:
        a, b = await new_session(client), await new_session(client)
        query = envelope(f"chat.query.{a}", "chat.query",
                         {"session_id": b, "content": "into the other"}, b)
        async with tapped(target.nats_url, "system.error") as (tap, nc):
            await nc.jetstream().publish(f"chat.query.{a}", query)
            [report] = await tap.until(lambda s, e: e.get("payload", {}).get("subject")
                                       == f"chat.query.{a}")
        assert report["payload"]["code"] == "invalid_message"
        assert "session" in report["payload"]["message"]
        await ask(client, b, "the next one")  # answered after the refused one, were it taken
        messages = (await client.get(f"/api/sessions/{b}")).json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["the next one"]


async def test_http_errors_are_json_with_a_code(target: Target) -> None:
    async with gateway(target) as client:
        missing = await client.post("/api/sessions/nosuchsession/messages",
                                    json={"content": "hi"})
        malformed = await client.post("/api/sessions", content=b"{not json",
                                      headers={"Content-Type": "application/json"})
    for response, status in ((missing, 404), (malformed, 400)):
        assert response.status_code == status
        assert {"code", "message"} <= set(response.json()["error"])
