"""One query over the whole real path: HTTP -> gateway -> NATS -> generator ->
Ollama API (the stand-in) -> JetStream history -> response.generation -> HTTP.

Every service is a real subprocess; NATS is a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import Iterator

import httpx
import nats
import pytest

from schemas import subjects
from schemas.envelope import Envelope
from schemas.messages import GenerationReport
from services.core.tokens import Calibration, estimate_tokens
from services.shared.bus import round_trip
from services.shared.sessions import SessionStore
from tests.events import until
from tests.nats_server import NatsServer
from tests.system import System, ask, new_session, put_live_setting, running_system
from tests.test_page import STATIC, PageParser


@pytest.fixture(scope="module")
def system(nats_url: str, stub_url: str) -> Iterator[System]:
    with running_system(nats_url, stub_url, services=("generator", "decider", "gateway",
                                                      "tools")) as running:
        yield running


@pytest.fixture
def client(system: System) -> Iterator[httpx.Client]:
    with system.client() as http:
        yield http


def test_query_travels_the_whole_path_and_is_stored(client: httpx.Client) -> None:
    sid = new_session(client, system="You are terse.")
    answer = ask(client, sid, "hello there")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["session_id"] == sid
    assert body["reply"] == "Echo: hello there (turn 1)"
    assert body["prompt_tokens"] > 0 and body["completion_tokens"] > 0

    second = ask(client, sid, "and again").json()
    assert second["reply"] == "Echo: and again (turn 2)"

    session = client.get(f"/api/sessions/{sid}").json()
    assert [(m["role"], m["content"]) for m in session["messages"]] == [
        ("user", "hello there"),
        ("assistant", "Echo: hello there (turn 1)"),
        ("user", "and again"),
        ("assistant", "Echo: and again (turn 2)"),
    ]
    assert session["state"] == "idle"
    assert session["num_ctx"] == 8192
    assert session["token_count"] > 0


async def test_each_generation_is_reported_with_the_providers_count(
    system: System, nats_url: str
) -> None:
    nc = await nats.connect(nats_url)
    reports: asyncio.Queue[Envelope[GenerationReport]] = asyncio.Queue()

    async def collect(msg: nats.aio.msg.Msg) -> None:
        await reports.put(Envelope[GenerationReport].model_validate_json(msg.data))

    await nc.subscribe(subjects.RESPONSE_GENERATION, cb=collect)
    await round_trip(nc)  # subscribed at the server before the turn reports
    async with system.http(timeout=30) as http:
        sid = (await http.post("/api/sessions", json={})).json()["session_id"]
        reply = (await http.post(f"/api/sessions/{sid}/messages",
                                 json={"content": "count me"})).json()
    report = await asyncio.wait_for(reports.get(), 10)
    record = await (await SessionStore.open(nc.jetstream())).get(sid)
    await nc.drain()
    # The page's gauge shows the next prompt as the generator and the decider
    # count it, the offered tools included.
    async with system.http(timeout=30) as http:
        shown = (await http.get(f"/api/sessions/{sid}")).json()["token_count"]
    assert shown == estimate_tokens(report.payload.next_prompt_chars or 0,
                                    Calibration(record.tokens_per_char),
                                    report.payload.next_prompt_messages)
    assert report.sender_id == "generator"
    assert report.session_id == sid
    assert report.payload.model == "stub-model"
    assert report.payload.prompt_tokens == reply["prompt_tokens"]
    assert report.payload.completion_tokens == reply["completion_tokens"]
    assert report.payload.num_ctx == 8192
    assert report.payload.sent_chars > len("count me")


def test_the_page_and_every_resource_it_references_are_served(client: httpx.Client) -> None:
    """A browser loading the page asks for nothing that is not there: a 404 for
    any of it (the icon above all, which browsers ask for unbidden) shows in its
    console on every load."""
    page = client.get("/")
    assert page.status_code == 200
    parser = PageParser()
    parser.feed(page.text)
    icons = [a for a in parser.links if "icon" in (a.get("rel") or "").split()]
    assert icons, "no declared icon: the browser would ask for /favicon.ico"
    referenced = [value for _, _, value in parser.refs]
    referenced += re.findall(r"url\(['\"]?([^'\")]+)", (STATIC / "style.css").read_text())
    for path in referenced:
        served = client.get(path)
        assert served.status_code == 200, f"{path}: {served.status_code}"
    assert client.get(str(icons[0]["href"])).headers["content-type"].startswith("image/")
    scripts = [value for tag, _, value in parser.refs if tag == "script"]
    assert scripts
    for path in served_modules(client, scripts):
        # A browser refuses to run a module served under any other type.
        assert client.get(path).headers["content-type"].split(";")[0] in JAVASCRIPT_TYPES, path


JAVASCRIPT_TYPES = ("text/javascript", "application/javascript")


def served_modules(client: httpx.Client, entries: list[str]) -> set[str]:
    """Every module the page's scripts import, followed through their imports."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        served = client.get(path)
        assert served.status_code == 200, f"{path}: {served.status_code}"
        base = path.rsplit("/", 1)[0]
        todo += [f"{base}/{name[2:]}" for name in re.findall(r'from "(\./[^"]+)"', served.text)]
    return seen


def test_unknown_session_is_404_with_a_json_error(client: httpx.Client) -> None:
    for response in (client.get("/api/sessions/nosuchsession"),
                     ask(client, "nosuchsession", "hi"),
                     client.post("/api/sessions/nosuchsession/compact")):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "unknown_session"


def test_an_unknown_path_or_method_is_a_json_error(client: httpx.Client) -> None:
    for response, status in ((client.get("/api/nothing-here"), 404),
                             (client.delete("/api/sessions"), 405)):
        assert response.status_code == status
        assert response.json()["error"]["message"].endswith(
            "Not Found" if status == 404 else "Method Not Allowed")


def test_the_event_stream_takes_an_empty_session_filter_as_none(client: httpx.Client) -> None:
    with client.stream("GET", "/api/events", params={"session_id": ""}) as events:
        assert events.status_code == 200
        assert next(events.iter_text()).startswith(": connected")


@pytest.mark.parametrize("body, field", [
    ({}, "content"),
    ({"content": ""}, "content"),
    ({"content": 12}, "content"),
    ({"content": "hi", "extra": 1}, "extra"),
])
def test_malformed_message_body_names_the_field(client: httpx.Client, body: object,
                                                 field: str) -> None:
    sid = new_session(client)
    response = client.post(f"/api/sessions/{sid}/messages", json=body)
    assert 400 <= response.status_code < 500
    assert response.json()["error"]["field"] == field


def test_body_that_is_not_json_is_a_clear_400(client: httpx.Client) -> None:
    sid = new_session(client)
    response = client.post(f"/api/sessions/{sid}/messages", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_session_ids_that_could_escape_a_subject_are_refused(client: httpx.Client) -> None:
    for bad in ("a.b", "a*", "a>", "x" * 65):
        response = client.get(f"/api/sessions/{bad}")
        assert response.status_code == 400, bad
        assert response.json()["error"]["code"] == "invalid_session_id"


def test_create_session_validates_its_body(client: httpx.Client) -> None:
    response = client.post("/api/sessions", json={"system": 5})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "system"
    created = client.post("/api/sessions", json={"system": "Be brief.", "model": "other"})
    assert created.status_code == 201
    session = client.get(f"/api/sessions/{created.json()['session_id']}").json()
    assert session["system"] == "Be brief." and session["model"] == "other"


def test_healthz_is_ok_while_connected(client: httpx.Client) -> None:
    assert client.get("/healthz").status_code == 200


async def test_every_service_answers_micro_discovery(system: System, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    wanted, names = {"gateway", "generator", "compaction-decider", "tools"}, set()
    async with asyncio.timeout(30):
        while not wanted <= names:  # pinged again until every service has answered
            await nc.publish("$SRV.PING", b"", reply=inbox)
            with contextlib.suppress(nats.errors.TimeoutError):
                while not wanted <= names:
                    names.add(json.loads((await sub.next_msg(timeout=1)).data)["name"])
    stats = json.loads((await nc.request("$SRV.STATS.generator", b"", timeout=10)).data)
    await nc.drain()
    assert stats["name"] == "generator" and "endpoints" in stats


async def test_malformed_messages_are_reported_and_kill_nothing(
    system: System, nats_url: str, client: httpx.Client
) -> None:
    nc = await nats.connect(nats_url)
    errors = await nc.subscribe(subjects.ERROR_SUBJECT)
    js = nc.jetstream()
    await js.publish(subjects.RESPONSE_GENERATION, b'{"payload": {"session_id": 3}}')
    await js.publish(subjects.COMPACTION_REQUEST, b"not json at all")
    await js.publish(subjects.query("somesession"), b'{"message_type": "chat.query"}')
    # A request is answered with the error too, not left to time out.
    refusal = await nc.request(subjects.stop("somesession"), b'{"payload": {}}', timeout=10)
    assert json.loads(refusal.data)["payload"]["code"] == "invalid_message"
    seen = set()
    for _ in range(4):
        msg = await errors.next_msg(timeout=10)
        report = json.loads(msg.data)["payload"]
        assert report["code"] == "invalid_message"
        seen.add(report["subject"])
    await nc.drain()
    assert seen == {subjects.RESPONSE_GENERATION, subjects.COMPACTION_REQUEST,
                    subjects.query("somesession"), subjects.stop("somesession")}
    sid = new_session(client)
    assert ask(client, sid, "still alive?").status_code == 200
    for name in ("generator", "decider", "gateway"):
        assert system[name].proc is not None and system[name].proc.poll() is None


def test_history_survives_restarting_every_service(private_nats: NatsServer,
                                                   stub_url: str) -> None:
    # A server of its own: the module's services must not answer for the restarted ones.
    with running_system(private_nats.url, stub_url) as system, system.client() as client:
        sid = new_session(client, system="Remember me.")
        ask(client, sid, "first")
        ask(client, sid, "second")
        before = client.get(f"/api/sessions/{sid}").json()
        exit_codes = system.stop()
        assert exit_codes == {"gateway": 0, "decider": 0, "generator": 0}
        system.start()
        after = client.get(f"/api/sessions/{sid}").json()
        assert after["messages"] == before["messages"]
        assert after["system"] == "Remember me."
        assert ask(client, sid, "third").json()["reply"] == "Echo: third (turn 3)"


def test_sessions_are_listed_newest_first(client: httpx.Client) -> None:
    first, second = new_session(client), new_session(client, model="other")
    listed = client.get("/api/sessions", params={"limit": 500}).json()["sessions"]
    ids = [s["session_id"] for s in listed]
    assert ids.index(second) < ids.index(first)
    assert next(s for s in listed if s["session_id"] == second)["model"] == "other"
    assert len(client.get("/api/sessions", params={"limit": 1}).json()["sessions"]) == 1
    # "²" is a digit to str.isdigit, not to int(); int() takes at most 4,300 digits.
    for limit in ("lots", "²", "0", "-1", "9" * 5000):
        bad = client.get("/api/sessions", params={"limit": limit})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "limit"


def test_the_session_says_where_it_compacts_by_itself_as_the_threshold_changes(
        private_nats: NatsServer, stub_url: str) -> None:
    """The page's gauge warned from 80 % whatever the threshold: set to 0.5
    live, compaction began where the gauge still read "ok"."""
    # A server of its own: the threshold is put into its `config` bucket.
    with running_system(private_nats.url, stub_url) as system, system.client() as client:
        sid = new_session(client)
        manual = new_session(client, auto_compact=False)
        session = client.get(f"/api/sessions/{sid}").json()
        assert session["compacts_at"] == math.ceil(0.8 * session["budget"])
        assert client.get(f"/api/sessions/{manual}").json()["compacts_at"] is None

        def compacts_at() -> object:
            return client.get(f"/api/sessions/{sid}").json()["compacts_at"]

        put_live_setting(private_nats.url, "compaction_threshold", b"0.5")
        until(lambda: compacts_at() == math.ceil(0.5 * session["budget"]), "the threshold read")
        put_live_setting(private_nats.url, "compaction_threshold", b"0")
        until(lambda: compacts_at() is None, "automatic compaction off")
