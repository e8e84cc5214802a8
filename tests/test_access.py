"""Who may come in, against the real gateway process: the Host check that
stops DNS rebinding, the Origin and content-type checks that stop cross-site
writes, the optional token, the body limit and the bound on event streams."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.events import eventually
from tests.system import System, running_system

TOKEN = "a-test-token-that-nobody-guesses"
FRIEND = "https://notebook.example:8443"
EVIL = "https://attacker.example"


@pytest.fixture(scope="module")
def open_gateway(nats_url: str, stub_url: str) -> Iterator[System]:
    """As `make run` starts it: no token, no extra hosts or origins."""
    with running_system(nats_url, stub_url, services=("generator", "gateway")) as system:
        yield system


@pytest.fixture(scope="module")
def locked_gateway(nats_url: str, stub_url: str) -> Iterator[System]:
    env = {"GATEWAY_TOKEN": TOKEN, "GATEWAY_ALLOWED_ORIGINS": FRIEND,
           "GATEWAY_ALLOWED_HOSTS": "chat.internal", "MAX_BODY_BYTES": "4096",
           "MAX_EVENT_STREAMS_PER_CLIENT": "2"}
    with running_system(nats_url, stub_url, env, services=("gateway",)) as system:
        yield system


@pytest.fixture
async def http(open_gateway: System) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=open_gateway.base_url, timeout=30) as client:
        yield client


@pytest.fixture
async def locked(locked_gateway: System) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=locked_gateway.base_url, timeout=30,
                                 headers={"Host": "chat.internal:8080"}) as client:
        yield client


def refused(response: httpx.Response, status: int, code: str, names: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert names in error["message"]
    assert "access-control-allow-origin" not in response.headers


JSON = {"Content-Type": "application/json"}
BEARER = {"Authorization": f"Bearer {TOKEN}", **JSON}


async def test_a_dns_rebinding_request_is_refused(http: httpx.AsyncClient) -> None:
    rebound = await http.get("/api/sessions", headers={"Host": "attacker.example"})
    refused(rebound, 421, "host_not_allowed", "GATEWAY_ALLOWED_HOSTS")
    page = await http.get("/", headers={"Host": "attacker.example:8080"})
    refused(page, 421, "host_not_allowed")


@pytest.mark.parametrize("host", ["localhost:8080", "127.0.0.1", "[::1]:9000", "LOCALHOST"])
async def test_loopback_names_are_answered_on_any_port(http: httpx.AsyncClient,
                                                       host: str) -> None:
    assert (await http.get("/api/sessions", headers={"Host": host})).status_code == 200


async def test_the_health_check_answers_any_host_and_no_token(
        http: httpx.AsyncClient, locked: httpx.AsyncClient) -> None:
    assert (await http.get("/healthz", headers={"Host": "attacker.example"})).status_code == 200
    assert (await locked.get("/healthz")).status_code == 200


async def test_a_listed_host_replaces_the_defaults(locked: httpx.AsyncClient) -> None:
    assert (await locked.get("/api/sessions", headers=BEARER)).status_code == 200
    refused(await locked.get("/api/sessions", headers={**BEARER, "Host": "localhost"}),
            421, "host_not_allowed")


async def test_a_text_plain_cross_site_post_is_refused(http: httpx.AsyncClient) -> None:
    # What any web page may send without a preflight.
    simple = {"Content-Type": "text/plain", "Origin": EVIL}
    refused(await http.post("/api/sessions", content=b"{}", headers=simple),
            403, "origin_not_allowed", "GATEWAY_ALLOWED_ORIGINS")
    sid = (await http.post("/api/sessions", json={})).json()["session_id"]
    for path in (f"/api/sessions/{sid}/messages", f"/api/sessions/{sid}/compact"):
        refused(await http.post(path, content=b'{"content": "hi"}', headers=simple),
                403, "origin_not_allowed")
    assert (await http.get(f"/api/sessions/{sid}")).json()["messages"] == []


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
async def test_a_write_needs_a_json_content_type(http: httpx.AsyncClient,
                                                 content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    sid = (await http.post("/api/sessions", json={})).json()["session_id"]
    for method, path in (("POST", "/api/sessions"), ("POST", f"/api/sessions/{sid}/compact"),
                         ("POST", f"/api/sessions/{sid}/stop"), ("DELETE", f"/api/sessions/{sid}")):
        response = await http.request(method, path, headers=headers, content=b"{}")
        refused(response, 415, "unsupported_media_type", "application/json")
    assert (await http.get(f"/api/sessions/{sid}")).status_code == 200  # not deleted


async def test_writes_from_our_own_page_and_with_charset_pass(open_gateway: System,
                                                             http: httpx.AsyncClient) -> None:
    own = open_gateway.base_url
    created = await http.post("/api/sessions", content=b"{}", headers={
        "Origin": own, "Content-Type": "application/json; charset=utf-8"})
    assert created.status_code == 201, created.text
    assert "access-control-allow-origin" not in created.headers
    sid = created.json()["session_id"]
    answer = await http.post(f"/api/sessions/{sid}/messages", json={"content": "hello"},
                             headers={"Origin": own})
    assert answer.status_code == 200, answer.text
    deleted = await http.delete(f"/api/sessions/{sid}", headers={"Origin": own, **JSON})
    assert deleted.status_code in (200, 204), deleted.text


async def test_a_foreign_origin_cannot_listen_to_the_live_feed(open_gateway: System,
                                                              http: httpx.AsyncClient) -> None:
    refused(await http.get("/api/events", headers={"Origin": EVIL}), 403, "origin_not_allowed")
    own = {"Origin": open_gateway.base_url}
    async with http.stream("GET", "/api/events", headers=own) as response:
        assert response.status_code == 200


async def test_preflights_are_answered_for_listed_origins_only(
        http: httpx.AsyncClient, locked: httpx.AsyncClient) -> None:
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    refused(await http.options("/api/sessions", headers={**ask, "Origin": EVIL}),
            403, "origin_not_allowed")
    refused(await locked.options("/api/sessions", headers={**ask, "Origin": EVIL}),
            403, "origin_not_allowed")
    friendly = await locked.options("/api/sessions", headers={**ask, "Origin": FRIEND})
    assert friendly.status_code == 204
    assert friendly.headers["access-control-allow-origin"] == FRIEND
    # Every header the API reads may be sent, the key a resend needs included.
    allowed = {h.strip() for h in friendly.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "accept", "idempotency-key"} <= allowed
    listed = await locked.get("/api/sessions", headers={**BEARER, "Origin": FRIEND})
    assert listed.headers["access-control-allow-origin"] == FRIEND
    created = await locked.post("/api/sessions", json={}, headers={**BEARER, "Origin": FRIEND})
    assert created.status_code == 201


@pytest.mark.parametrize("path", ["/api/sessions", "/api/events", "/", "/static/app.js"])
async def test_a_missing_or_wrong_token_is_unauthorized(locked: httpx.AsyncClient,
                                                        path: str) -> None:
    refused(await locked.get(path), 401, "unauthorized", "no token")
    refused(await locked.get(path, headers={"Authorization": "Bearer guess"}),
            401, "unauthorized", "a wrong token")
    refused(await locked.get(path, headers={"Authorization": f"Basic {TOKEN}"}),
            401, "unauthorized")


async def test_the_bearer_token_opens_the_api(locked: httpx.AsyncClient) -> None:
    created = await locked.post("/api/sessions", json={}, headers=BEARER)
    assert created.status_code == 201
    sid = created.json()["session_id"]
    assert (await locked.get(f"/api/sessions/{sid}", headers=BEARER)).status_code == 200
    refused(await locked.post("/api/sessions", json={}), 401, "unauthorized")


async def test_the_page_takes_the_token_once_and_keeps_it_in_a_strict_cookie(
        locked: httpx.AsyncClient) -> None:
    refused(await locked.get("/?token=guess"), 401, "unauthorized")
    first = await locked.get(f"/?token={TOKEN}")
    assert first.status_code == 303 and first.headers["location"] == "/"
    cookie = first.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert first.cookies["gateway_token"] == TOKEN
    page = await locked.get("/")  # the client keeps the cookie, as a browser does
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert (await locked.get("/api/sessions")).status_code == 200
    async with locked.stream("GET", "/api/events") as events:
        assert events.status_code == 200


@pytest.mark.parametrize("token", ["%E2%82%AC", "%FF", "guess"])
async def test_a_page_token_where_none_is_set_is_no_error_and_no_cookie(
        http: httpx.AsyncClient, token: str) -> None:
    """A token a cookie cannot hold (`?token=€`) answered 500."""
    first = await http.get(f"/?token={token}")
    assert first.status_code == 303 and "set-cookie" not in first.headers


@pytest.mark.parametrize("path", ["/", "/api/sessions", "/healthz", "/?token=x", "/nowhere"])
async def test_no_other_site_may_frame_what_the_gateway_serves(
        http: httpx.AsyncClient, path: str) -> None:
    """Framed by another site, the page's requests carry its own Origin, and a
    user's clicks there are the page's."""
    headers = (await http.get(path)).headers
    assert headers["x-frame-options"] == "DENY"
    assert headers["content-security-policy"] == "frame-ancestors 'none'"
    assert headers["x-content-type-options"] == "nosniff"
    refusal = (await http.get(path, headers={"Host": "attacker.example"})).headers
    assert refusal["x-frame-options"] == "DENY"


async def test_a_body_over_the_limit_is_refused_before_it_is_read(
        locked: httpx.AsyncClient) -> None:
    big = b'{"content": "' + b"x" * 5000 + b'"}'
    refused(await locked.post("/api/sessions", content=big, headers=BEARER),
            413, "body_too_large", "MAX_BODY_BYTES")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length to trust
        for _ in range(10):
            yield b" " * 1000

    refused(await locked.post("/api/sessions", content=chunks(), headers=BEARER),
            413, "body_too_large")
    within = await locked.post("/api/sessions", content=b" " * 4000 + b"{}", headers=BEARER)
    assert within.status_code == 201, within.text


async def test_event_streams_per_client_are_bounded(locked_gateway: System) -> None:
    async with httpx.AsyncClient(base_url=locked_gateway.base_url, timeout=30, headers={
            "Host": "chat.internal", **BEARER}) as client:
        async with client.stream("GET", "/api/events") as one, \
                client.stream("GET", "/api/events") as two:
            assert (one.status_code, two.status_code) == (200, 200)
            refused(await client.get("/api/events"), 429, "too_many_streams",
                    "MAX_EVENT_STREAMS_PER_CLIENT")

        async def admitted_again() -> bool:
            async with client.stream("GET", "/api/events") as again:
                return again.status_code == 200
        await eventually(admitted_again, "a closed stream's place given back")


def test_an_auto_token_is_made_and_its_page_address_logged(nats_url: str,
                                                           stub_url: str) -> None:
    with running_system(nats_url, stub_url, {"GATEWAY_TOKEN": "auto"},
                        services=("gateway",)) as system:
        log = system["gateway"].log()
        line = next(line for line in log.splitlines() if "gateway_token_made" in line)
        token = line.split("?token=")[1].split()[0].strip("\"',}")
        with system.client() as client:
            assert client.get("/api/sessions").status_code == 401
            headers = {"Authorization": f"Bearer {token}"}
            assert client.get("/api/sessions", headers=headers).status_code == 200


@pytest.mark.parametrize("page_token", ["", "guess"])
async def test_a_page_token_that_is_not_the_token_never_becomes_the_cookie(
        locked: httpx.AsyncClient, page_token: str) -> None:
    """Let in by a good cookie or header, `/?token=` with an empty or wrong
    value overwrote the cookie, locking the page out (or keeping a guess)."""
    assert (await locked.get(f"/?token={TOKEN}")).status_code == 303  # the cookie is kept
    again = await locked.get(f"/?token={page_token}")  # a wrong one is refused
    assert again.status_code == (303 if page_token == "" else 401)
    assert "set-cookie" not in again.headers
    assert (await locked.get("/api/sessions")).status_code == 200
    locked.cookies.clear()
    with_header = await locked.get(f"/?token={page_token}", headers=BEARER)
    assert with_header.status_code == 303 and "set-cookie" not in with_header.headers
