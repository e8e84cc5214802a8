"""The gateway's access rules as pure functions, over plain request facts."""

from __future__ import annotations

import itertools

import pytest

from services.gateway.access_rules import (
    Facts,
    Policy,
    bearer,
    host_name,
    host_names,
    is_json,
    judge,
    origins,
    preflight_allowed,
)

OPEN = Policy(allowed_hosts=host_names("", "127.0.0.1"), allowed_origins=frozenset(),
              token=None, max_body_bytes=1000)
LOCKED = Policy(allowed_hosts=host_names("chat.internal, other.example", "0.0.0.0"),
                allowed_origins=origins("https://friend.example/"), token="s3cret",
                max_body_bytes=1000)


def facts(**given: object) -> Facts:
    base: dict[str, object] = {"method": "GET", "path": "/api/sessions", "scheme": "http",
                               "host": "localhost:8080"}
    return Facts(**{**base, **given})  # type: ignore[arg-type]


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8080", "localhost"), ("LOCALHOST", "localhost"), ("[::1]:9", "[::1]"),
    ("[::1]", "[::1]"), ("127.0.0.1:80", "127.0.0.1"), ("example.com.", "example.com"),
    ("", ""), ("[broken", "[broken")])
def test_host_name_drops_the_port(header: str, name: str) -> None:
    assert host_name(header) == name


def test_default_hosts_are_loopback_plus_a_specific_bind() -> None:
    assert host_names("", "0.0.0.0") == {"localhost", "127.0.0.1", "[::1]"}
    assert host_names("", "::") == {"localhost", "127.0.0.1", "[::1]"}
    assert host_names("", "192.168.1.5") == {"localhost", "127.0.0.1", "[::1]", "192.168.1.5"}
    assert "[fe80::1]" in host_names("", "fe80::1")
    assert host_names(" A.example ,b.example,", "0.0.0.0") == {"a.example", "b.example"}


@pytest.mark.parametrize(("value", "expected"), [
    ("application/json", True), ("Application/JSON; charset=utf-8", True),
    ("text/plain", False), ("application/jsonx", False), (None, False), ("", False)])
def test_is_json(value: str | None, expected: bool) -> None:
    assert is_json(value) is expected


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None),
    (None, None), ("", None)])
def test_bearer(header: str | None, token: str | None) -> None:
    assert bearer(header) == token


def test_the_health_check_is_open_to_anyone() -> None:
    for policy in (OPEN, LOCKED):
        assert judge(facts(path="/healthz", host="attacker.example"), policy) is None


def test_a_foreign_host_is_refused_before_anything_else() -> None:
    refusal = judge(facts(method="POST", host="attacker.example", origin="https://x"), LOCKED)
    assert refusal and (refusal.status, refusal.code) == (421, "host_not_allowed")
    assert judge(facts(host="*"), OPEN) is not None
    star = Policy(frozenset({"*"}), frozenset(), None, 1000)
    assert judge(facts(host="anything.example"), star) is None


@pytest.mark.parametrize(("method", "path", "origin", "status"), [
    ("POST", "/api/sessions", "https://attacker.example", 403),
    ("DELETE", "/api/sessions/a", "null", 403),
    ("GET", "/api/events", "https://attacker.example", 403),
    ("GET", "/api/sessions", "https://attacker.example", None),  # a read: CORS keeps it
    ("POST", "/api/sessions", "http://localhost:8080", None),  # our own page
    ("POST", "/api/sessions", "http://LOCALHOST:8080/", None),
    ("POST", "/api/sessions", "https://localhost:8080", 403),  # another scheme
    ("POST", "/api/sessions", "http://localhost:9999", 403),  # another port
    ("POST", "/api/sessions", None, None),  # not a browser
])
def test_the_origin_of_writes_and_listeners(method: str, path: str, origin: str | None,
                                            status: int | None) -> None:
    refusal = judge(facts(method=method, path=path, origin=origin,
                          content_type="application/json"), OPEN)
    assert (refusal.status if refusal else None) == status


def test_a_listed_origin_may_write_and_preflight() -> None:
    friend = facts(method="POST", host="chat.internal", origin="https://FRIEND.example",
                   content_type="application/json", token="s3cret")
    assert judge(friend, LOCKED) is None
    assert preflight_allowed("https://friend.example", LOCKED)
    assert not preflight_allowed("https://attacker.example", LOCKED)
    assert not preflight_allowed(None, LOCKED)
    assert not preflight_allowed("http://localhost:8080", OPEN)  # our own needs none


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "multipart/form-data"])
def test_every_write_needs_json(method: str, content_type: str | None) -> None:
    refusal = judge(facts(method=method, content_type=content_type), OPEN)
    assert refusal and refusal.status == 415


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
def test_reads_need_no_content_type(method: str) -> None:
    assert judge(facts(method=method), OPEN) is None


@pytest.mark.parametrize("token", [None, "", "s3cre", "s3cret ", "S3CRET"])
def test_anything_but_the_token_is_unauthorized(token: str | None) -> None:
    refusal = judge(facts(host="chat.internal", token=token), LOCKED)
    assert refusal and refusal.status == 401
    assert judge(facts(host="chat.internal", token="s3cret"), LOCKED) is None


@pytest.mark.parametrize(("length", "refused"), [(None, False), (1000, False), (1001, True)])
def test_a_declared_length_over_the_limit(length: int | None, refused: bool) -> None:
    refusal = judge(facts(method="POST", content_type="application/json",
                          content_length=length), OPEN)
    assert (refusal is not None and refusal.status == 413) is refused


def test_every_combination_is_judged_by_the_first_rule_it_breaks() -> None:
    """Host, then origin, then token, then content type, then size."""
    options = itertools.product(["chat.internal", "attacker.example"],
                                [None, "https://attacker.example"], [None, "s3cret"],
                                [None, "application/json"], [None, 5000])
    for host, origin, token, content_type, length in options:
        refusal = judge(facts(method="POST", host=host, origin=origin, token=token,
                              content_type=content_type, content_length=length), LOCKED)
        expected = (421 if host != "chat.internal" else 403 if origin else
                    401 if not token else 415 if not content_type else
                    413 if length else None)
        assert (refusal.status if refusal else None) == expected
