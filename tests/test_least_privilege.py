"""The NATS users shipped in nats-users.conf, on the repository's own nats.conf
as `make run` starts it: the whole product works with each service as its
own user and no refusal logged by the server, and each service is refused
what it has no business doing, which it logs as an error naming the subject."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import structlog

from schemas import subjects
from scripts.nats_passwords import (
    PASSWORD_VARIABLES,
    ROUTE_PASSWORD_VARIABLE,
    kept_passwords,
    new_password,
    service_credentials,
)
from services.shared.bus import connect
from tests.events import Watcher, eventually, server_sent_events, until, watching
from tests.nats_server import NatsServer, ShippedNats, running_shipped_nats
from tests.stub_server import configure_stub, model_called, stub_stats
from tests.system import System, put_live_setting

ADMIN = "admin"
EVENTS = (subjects.COMPACTION_RESULT,)


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[ShippedNats]:
    with running_shipped_nats(tmp_path) as shipped:
        yield shipped


@pytest.fixture
def system(secured: ShippedNats, stub_url: str) -> Iterator[System]:
    """Every service, each with its own NATS user and nothing else."""
    everyone = System(f"nats://127.0.0.1:{secured.server.port}", stub_url, services=(),
                      env={"NUM_CTX": "2048", "COMPACTION_TAIL_TURNS": "2"})
    for name, module in (("tools", "services.tools"), ("generator", "services.generator"),
                         ("decider", "services.compaction_decider"),
                         ("gateway", "services.gateway")):
        everyone.add(name, module, service_credentials(module, secured.passwords))
    try:
        yield everyone.start()
    finally:
        everyone.stop()


async def test_the_whole_product_works_with_each_service_as_its_own_user(
        secured: ShippedNats, system: System, stub_url: str) -> None:
    async with system.http() as http, watching(secured.url_for(ADMIN), *EVENTS) as watcher:
        sid = await converse(http)
        assert (await http.post(f"/api/sessions/{sid}/compact")).status_code == 202
        await watcher.wait_until(lambda: completed(watcher, sid) >= 1, 30)
        auto = str((await http.post("/api/sessions", json={})).json()["session_id"])
        for turn in range(12):
            await ask(http, auto, f"question {turn} !long 1200")
            if completed(watcher, auto):
                break
        await watcher.wait_until(lambda: completed(watcher, auto) >= 1, 30)
        await every_other_route(http, sid)
        await withdrawn_while_queued(http, sid, secured, stub_url)
        assert (await http.delete(f"/api/sessions/{sid}")).status_code == 204
        assert (await http.get(f"/api/sessions/{sid}")).status_code == 404
    assert "Violation" not in secured.server.log(), secured.server.log()[-3000:]
    assert "nats_permission_denied" not in system.logs(), system.logs()


async def converse(http: httpx.AsyncClient) -> str:
    """A streamed answer (the live feed), a tool that reads the history, and
    a few more turns for a compaction to fold."""
    sid = str((await http.post("/api/sessions", json={"auto_compact": False})).json()[
        "session_id"])
    async with http.stream("POST", f"/api/sessions/{sid}/messages",
                           json={"content": "hello, my locker code is 4711"},
                           headers={"Accept": "text/event-stream"}) as response:
        names = [name async for name, _ in server_sent_events(response)]
    assert names[-1] == "done" and "token" in names, names
    recalled = await ask(http, sid, '!tool recall {"query": "locker code"}')
    assert "4711" in recalled["reply"], recalled
    for turn in range(4):
        await ask(http, sid, f"more {turn} !long 300")
    return sid


async def ask(http: httpx.AsyncClient, sid: str, content: str) -> dict[str, Any]:
    response = await http.post(f"/api/sessions/{sid}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return dict(response.json())


async def every_other_route(http: httpx.AsyncClient, sid: str) -> None:
    """The page, the lists, the transcript, the live events, stop and retry."""
    for path in ("/", "/api/sessions", f"/api/sessions/{sid}",
                 f"/api/sessions/{sid}/transcript"):
        response = await http.get(path)
        assert response.status_code == 200, (path, response.text)
    async with http.stream("GET", "/api/events", params={"session_id": sid}) as events:
        lines = events.aiter_lines()
        while await anext(lines) != ": connected":
            pass
        asking = asyncio.create_task(ask(http, sid, "while the page watches"))
        while not (await anext(lines)).startswith("event: "):
            pass
        await asking
    assert (await http.post(f"/api/sessions/{sid}/stop")).status_code in (200, 409)
    retried = await http.post(f"/api/sessions/{sid}/retry")
    assert retried.status_code == 200, retried.text


async def withdrawn_while_queued(http: httpx.AsyncClient, sid: str, secured: ShippedNats,
                                 stub_url: str) -> None:
    """A message stopped while it waits behind another answer: the gateway
    takes it out of the queue and keeps its error reply."""
    calls = int((await stub_stats(stub_url))["requests"])
    await configure_stub(stub_url, held_models=["stub-model"])
    try:
        ahead = asyncio.create_task(ask(http, sid, "held a while"))
        await model_called(stub_url, calls + 1)
        key = {"Idempotency-Key": "withdrawn-while-queued"}
        queued = asyncio.create_task(http.post(f"/api/sessions/{sid}/messages",
                                               json={"content": "never mind"}, headers=key))
        await eventually(lambda: queries_waiting(secured, 2), "the second message queued")
        stop = await http.post(f"/api/sessions/{sid}/stop", headers=key)
        assert stop.status_code == 202 and stop.json()["status"] == "withdrawn", stop.text
        assert (await queued).json()["error"]["code"] == "withdrawn"
    finally:
        await configure_stub(stub_url, held_models=[])
    await ahead


async def queries_waiting(secured: ShippedNats, count: int) -> bool:
    nc = await nats.connect(secured.url_for(ADMIN))
    try:
        return (await nc.jetstream().stream_info(subjects.QUERIES_STREAM)).state.messages >= count
    finally:
        await nc.close()


def completed(watcher: Watcher, sid: str) -> int:
    return sum(1 for p in watcher.payloads(subjects.COMPACTION_RESULT)
               if p["session_id"] == sid and p["status"] == "completed")


SERVER_WORD = {"publish": "publish", "subscribe": "subscription"}

# One forbidden action per service: what it would do if it were compromised.
FORBIDDEN = [
    ("gateway", "publish", "history.victim"),          # rewrite a session's history
    ("tools", "publish", "history.victim"),
    ("tools", "publish", "chat.reply.victim"),         # answer in the model's place
    ("compaction-decider", "publish", "chat.reply.victim"),
    ("compaction-decider", "publish", "$JS.API.DIRECT.GET.HISTORY"),  # read every transcript
    ("generator", "publish", "$JS.API.STREAM.DELETE.HISTORY"),  # destroy every history
    ("tools", "subscribe", "chat.token.*"),            # read every conversation live
    ("gateway", "subscribe", "_INBOX_generator.>"),    # read another service's replies
]


@pytest.mark.parametrize(("user", "operation", "subject"), FORBIDDEN)
async def test_each_service_is_refused_what_it_has_no_business_doing(
        secured: ShippedNats, user: str, operation: str, subject: str) -> None:
    with structlog.testing.capture_logs() as logs:
        nc = await connect(secured.url_for(user), user)  # as the services connect
        try:
            if operation == "publish":
                await nc.publish(subject, b"{}")
            else:
                await nc.subscribe(subject)
            await eventually(lambda: any(e["event"] == "nats_permission_denied" for e in logs),
                             f"{user} was told it may not {operation} {subject}")
        finally:
            await nc.close()
    denied = next(e for e in logs if e["event"] == "nats_permission_denied")
    assert (denied["log_level"], denied["operation"]) == ("error", SERVER_WORD[operation])
    assert denied["subject"] == subject.lower()  # nats-py lower-cases the server's words
    # The server tells the client before it writes its log line.
    await eventually(lambda: f'Subject "{subject}"' in secured.server.log(),
                     "the server logged the refusal")
    assert await history_of(secured, "victim") == 0


async def test_without_a_user_nothing_gets_in(secured: ShippedNats) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(f"nats://127.0.0.1:{secured.server.port}", allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)


async def history_of(secured: ShippedNats, sid: str) -> int:
    """Messages stored on the session's history subject (0 when the stream is
    not even made yet)."""
    nc = await nats.connect(secured.url_for(ADMIN))
    try:
        info = await nc.jetstream().stream_info(subjects.HISTORY_STREAM,
                                                subjects_filter=subjects.history(sid))
    except nats.js.errors.NotFoundError:
        return 0
    finally:
        await nc.close()
    return int((info.state.subjects or {}).get(subjects.history(sid), 0))


def test_passwords_are_made_once_kept_private_and_always_readable_by_the_server(
        tmp_path: Path) -> None:
    kept = tmp_path / ".data" / "nats-passwords.env"
    first = kept_passwords(kept)
    assert set(first) == {*PASSWORD_VARIABLES.values(), ROUTE_PASSWORD_VARIABLE}
    assert kept.stat().st_mode & 0o777 == 0o600
    assert kept_passwords(kept) == first  # the next run finds the same
    kept.write_text(kept.read_text().replace("NATS_TOOLS_PASSWORD", "# gone"))
    again = kept_passwords(kept)
    assert {k: v for k, v in again.items() if k != "NATS_TOOLS_PASSWORD"} == {
        k: v for k, v in first.items() if k != "NATS_TOOLS_PASSWORD"}
    for password in (new_password() for _ in range(2000)):
        assert password[0].isalpha() and password.isalnum() and len(password) == 32


def test_a_gateway_its_user_may_not_watch_the_settings_serves_all_the_same(
        tmp_path: Path, stub_url: str) -> None:
    """Users written before the gateway watched the live settings: it would
    not start at all, for a mark on the page's gauge."""
    shipped = Path(__file__).resolve().parents[1]
    # Without its monitoring port, which the server is given on its command
    # line here: a reload would refuse the difference.
    conf = (shipped / "nats.conf").read_text()
    (tmp_path / "nats.conf").write_text(re.sub(r"(?m)^http_port:.*$", "", conf))
    users = (shipped / "nats-users.conf").read_text()
    older = users.replace('"$JS.API.CONSUMER.*.KV_config", "$JS.API.CONSUMER.*.KV_config.>", '
                          '"$JS.FC.KV_config.>",', "", 1)
    assert older != users
    (tmp_path / "nats-users.conf").write_text(older)
    passwords = kept_passwords(tmp_path / "nats-passwords.env")
    store = tmp_path / "store"
    store.mkdir()
    server = NatsServer(str(store), env=passwords, shipped_config=tmp_path / "nats.conf")
    server.start()
    gateway = System(f"nats://127.0.0.1:{server.port}", stub_url, services=(),
                     env={"COMPACTION_THRESHOLD": "0.5"})
    gateway.add("gateway", "services.gateway",
                service_credentials("services.gateway", passwords))
    try:
        with gateway.start().client() as client:
            created = client.post("/api/sessions", json={})
            assert created.status_code == 201, created.text
            sid = created.json()["session_id"]
            session = client.get(f"/api/sessions/{sid}").json()
            assert session["compacts_at"] == -(-session["budget"] // 2)
            until(lambda: "live_settings_unwatched" in gateway.logs(), "the refusal logged")
            # The users file mended and read again, the watch takes without a restart.
            (tmp_path / "nats-users.conf").write_text(users)
            server.signal(signal.SIGHUP)
            put_live_setting(ShippedNats(server, passwords).url_for(ADMIN),
                             "compaction_threshold", b"0.25")
            until(lambda: client.get(f"/api/sessions/{sid}").json()["compacts_at"]
                  == -(-session["budget"] // 4), "the threshold followed", timeout_s=90)
    finally:
        gateway.stop()
        server.stop()

