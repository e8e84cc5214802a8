"""Who may come in: the rules every HTTP request meets before a route runs.

Loopback binding alone does not protect a local API: a page in the user's
own browser can reach it, by DNS rebinding (a foreign name resolving to
127.0.0.1) or by a cross-site "simple request" (a `text/plain` POST needs no
preflight). So the gateway checks the Host, the Origin of anything that
writes or listens, the content type of writes, an optional token, and the
size of a body. The rules are pure: plain facts about a request in, a refusal
or nothing out.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

# Hosts a browser uses for this machine; a wildcard bind adds nothing.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_BINDS = ("", "0.0.0.0", "::", "[::]")
# Methods that change something; the rest only read.
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Readable by anyone who reaches the port: a health check reveals nothing.
OPEN_PATHS = frozenset({"/healthz"})
# A listener of the live feed is a read, but a cross-site one would read
# every conversation as it happens.
LISTENING_PATHS = frozenset({"/api/events"})
TOKEN_COOKIE = "gateway_token"


@dataclass(frozen=True)
class Policy:
    allowed_hosts: frozenset[str]  # host names without a port; "*" allows any
    allowed_origins: frozenset[str]  # "scheme://host[:port]", beside our own
    token: str | None
    max_body_bytes: int


@dataclass(frozen=True)
class Facts:
    """What the rules look at in one request."""

    method: str
    path: str
    scheme: str
    host: str  # the Host header as sent
    origin: str | None = None
    content_type: str | None = None
    content_length: int | None = None
    token: str | None = None  # from the Authorization header or the cookie


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str


def host_names(setting: str, bind_host: str) -> frozenset[str]:
    """`GATEWAY_ALLOWED_HOSTS` (comma-separated) or, when empty, loopback
    plus the address the gateway is bound to."""
    listed = split_list(setting)
    if not listed:
        listed = [*LOOPBACK_HOSTS]
        if bind_host not in WILDCARD_BINDS:
            listed.append(f"[{bind_host}]" if ":" in bind_host else bind_host)
    return frozenset(name.lower().rstrip(".") for name in listed)


def origins(setting: str) -> frozenset[str]:
    return frozenset(normal_origin(o) for o in split_list(setting))


def split_list(setting: str) -> list[str]:
    return [part.strip() for part in setting.split(",") if part.strip()]


def normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def host_name(host: str) -> str:
    """The Host header without its port: `[::1]:8080` -> `[::1]`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".")


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    return "*" in allowed or (bool(host) and host_name(host) in allowed)


def origin_allowed(facts: Facts, allowed: frozenset[str]) -> bool:
    """Our own origin (the Host the request was sent to, already checked) or
    one the settings list. `null` (a sandboxed or file page) is nobody's."""
    if facts.origin is None:
        return True
    origin = normal_origin(facts.origin)
    return origin == f"{facts.scheme}://{facts.host.strip().lower()}" or origin in allowed


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == "application/json"


def token_matches(given: str | None, expected: str) -> bool:
    # Constant time: how far a guess matched must not show in the answer's timing.
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def judge(facts: Facts, policy: Policy) -> Refusal | None:
    """The first rule the request breaks, or None to let it in."""
    if facts.path in OPEN_PATHS:
        return None
    for rule in (_host, _origin, _token, _content_type, _size):
        refusal = rule(facts, policy)
        if refusal:
            return refusal
    return None


def _host(facts: Facts, policy: Policy) -> Refusal | None:
    if host_allowed(facts.host, policy.allowed_hosts):
        return None
    return Refusal(421, "host_not_allowed",
                   f"Host {facts.host!r} is not one this gateway answers to; add its name "
                   "to GATEWAY_ALLOWED_HOSTS (comma-separated) to allow it")


def _origin(facts: Facts, policy: Policy) -> Refusal | None:
    checked = facts.method in WRITES or facts.path in LISTENING_PATHS
    if not checked or origin_allowed(facts, policy.allowed_origins):
        return None
    return Refusal(403, "origin_not_allowed",
                   f"requests from {facts.origin!r} are refused; add that origin to "
                   "GATEWAY_ALLOWED_ORIGINS (comma-separated) to allow it")


def _token(facts: Facts, policy: Policy) -> Refusal | None:
    if policy.token is None or token_matches(facts.token, policy.token):
        return None
    said = "a wrong token" if facts.token else "no token"
    return Refusal(401, "unauthorized",
                   f"{said}: send 'Authorization: Bearer <GATEWAY_TOKEN>', or open the "
                   "page once at /?token=<GATEWAY_TOKEN>")


def _content_type(facts: Facts, policy: Policy) -> Refusal | None:
    if facts.method not in WRITES or is_json(facts.content_type):
        return None
    return Refusal(415, "unsupported_media_type",
                   f"{facts.method} needs 'Content-Type: application/json' "
                   f"(got {facts.content_type or 'none'})")


def _size(facts: Facts, policy: Policy) -> Refusal | None:
    if facts.content_length is None or facts.content_length <= policy.max_body_bytes:
        return None
    return body_too_large(policy.max_body_bytes)


def body_too_large(limit: int) -> Refusal:
    return Refusal(413, "body_too_large",
                   f"the body is over {limit:,} bytes; MAX_BODY_BYTES sets the limit")


def preflight_allowed(origin: str | None, policy: Policy) -> bool:
    """A CORS preflight is answered for a listed origin only: our own page
    never needs one."""
    return origin is not None and normal_origin(origin) in policy.allowed_origins


def bearer(authorization: str | None) -> str | None:
    scheme, _, value = (authorization or "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None

