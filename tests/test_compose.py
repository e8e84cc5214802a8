"""compose.yaml: its NATS configuration (the repository's nats.conf) on a
real nats-server, and, with `make test-compose`, the whole stack on a real
Docker engine: streaming, compaction, a generator killed mid-answer, NATS
restarted, down and up again, down -v."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import yaml

from schemas import subjects
from scripts.nats_passwords import PASSWORD_VARIABLES, ROUTE_PASSWORD_VARIABLE, kept_passwords
from services.shared.jetstream import MAX_MESSAGE_BYTES, ensure_layout
from services.shared.nats_auth import inbox_prefix
from services.shared.runner import SHUTDOWN_TIMEOUT_S
from tests.compose_stack import Stack, prepare_images, why_docker_cannot_run
from tests.events import server_sent_events, server_sent_lines
from tests.nats_cluster import wait_for_jetstream
from tests.nats_server import NatsServer, running_shipped_nats
from tests.ports import free_port
from tests.stub_server import configure_stub
from tests.system import gateway_client

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


def test_the_nats_service_runs_the_repository_configuration_read_only() -> None:
    nats_service = compose()["services"]["nats"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats_service["volumes"]
    assert "./nats-users.conf:/etc/nats/nats-users.conf:ro" in nats_service["volumes"]
    assert nats_service["command"] == ["nats-server", "-c", "/etc/nats/nats.conf"]
    assert "configs" not in compose()  # docker-compose 1.29 rejects inline configs


def test_every_nats_node_of_the_cluster_file_has_the_users_and_their_passwords() -> None:
    cluster = yaml.safe_load((ROOT / "compose.cluster.yaml").read_text())["services"]
    for node in ("nats-2", "nats-3"):
        assert "./nats-users.conf:/etc/nats/nats-users.conf:ro" in cluster[node]["volumes"]
        assert "NATS_GATEWAY_PASSWORD" in cluster[node]["environment"], node
    assert "NATS_ADMIN_PASSWORD" in compose()["services"]["nats"]["environment"]


def test_every_service_waits_for_a_healthy_nats_and_has_a_healthcheck() -> None:
    services = compose()["services"]
    for name in ("gateway", "generator", "compaction-decider", "tools"):
        assert services[name]["depends_on"] == {"nats": {"condition": "service_healthy"}}
        assert services[name]["healthcheck"]["test"], name
        assert services[name]["environment"]["NATS_USER"] in ("gateway", "generator",
                                                             "compaction-decider", "tools")
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port  # loopback only


def test_every_service_may_finish_its_own_stop_before_docker_kills_it() -> None:
    services = compose()["services"]
    for name in ("gateway", "generator", "compaction-decider", "tools"):
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > SHUTDOWN_TIMEOUT_S + 2, name


async def test_the_nats_configuration_takes_the_largest_history_entry(tmp_path: Path) -> None:
    with running_shipped_nats(tmp_path) as shipped:  # as `make run` starts it
        nc = await nats.connect(shipped.url_for("generator"),
                                inbox_prefix=inbox_prefix("generator"))
        try:
            assert nc.max_payload >= MAX_MESSAGE_BYTES
            js = nc.jetstream()
            await ensure_layout(js)
            entry = b"x" * (MAX_MESSAGE_BYTES - 64 * 1024)  # room for headers
            ack = await js.publish(subjects.history("big"), entry, timeout=10)
            assert ack.stream == subjects.HISTORY_STREAM
        finally:
            await nc.close()
    assert (Path(shipped.server.store_dir) / "jetstream").is_dir()  # where the config says


CLUSTER_NODES = ("nats", "nats-2", "nats-3")


def cluster_nodes_on_loopback(root: Path, passwords: dict[str, str]) -> list[NatsServer]:
    """compose.cluster.yaml's nodes as it starts them, each with its command
    line and the variables it sets, but the hosts of the compose network
    moved to loopback ports. No secret is on a command line, where `ps` on
    the Docker host shows it: the route password is in the environment."""
    services = yaml.safe_load((ROOT / "compose.cluster.yaml").read_text())["services"]
    route_ports = {name: free_port() for name in CLUSTER_NODES}

    def on_loopback(value: str, name: str) -> str:
        value = re.sub(r"\$\{NATS_ROUTE_PASSWORD[^}]*\}", passwords[ROUTE_PASSWORD_VARIABLE], value)
        value = value.replace("0.0.0.0:6222", f"127.0.0.1:{route_ports[name]}")
        for other, port in route_ports.items():
            value = value.replace(f"@{other}:6222", f"@127.0.0.1:{port}")
        return value

    nodes = []
    for name in CLUSTER_NODES:
        assert services[name]["command"] == ["nats-server", "-c", "/etc/nats/nats-cluster.conf"]
        routes = {key: on_loopback(str(value), name)
                  for key, value in services[name]["environment"].items()
                  if key.startswith("NATS_ROUTE") or key == "NATS_SERVER_NAME"}
        (root / name).mkdir()
        nodes.append(NatsServer(str(root / name), env={**passwords, **routes},
                                shipped_config=ROOT / "nats-cluster.conf"))
    return nodes


async def route_answer(port: int, password: str) -> bytes:
    """What a node's route port says to a stranger claiming to be a node."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readline()  # INFO
        connect = {"user": "route", "pass": password, "name": "stranger", "cluster": "chat"}
        writer.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()


async def test_the_cluster_file_nodes_join_each_other_and_refuse_a_route_without_the_password(
        tmp_path: Path) -> None:
    passwords = kept_passwords(tmp_path / "passwords.env")
    nodes = cluster_nodes_on_loopback(tmp_path, passwords)
    admin = passwords[PASSWORD_VARIABLES["admin"]]
    try:
        for node in nodes:
            node.start()
        await wait_for_jetstream(
            ",".join(f"nats://admin:{admin}@127.0.0.1:{node.port}" for node in nodes), 3)
        route_port = int(nodes[0].env["NATS_ROUTE_LISTEN"].rpartition(":")[2])
        assert b"Authorization Violation" in await route_answer(route_port, "guessed")
    finally:
        for node in nodes:
            node.stop()


# ---------------------------------------------------------------- on a Docker engine

# A small window so that a few `!long` answers call for a compaction.
STACK_ENV = {"NUM_CTX": "2048", "COMPACTION_TAIL_TURNS": "2"}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    reason = why_docker_cannot_run()
    if reason:
        pytest.skip(f"Docker cannot run here: {reason}")
    prepare_images()
    started = Stack(STACK_ENV)
    try:
        started.compose("build", "-q")
        yield started
    finally:
        with contextlib.suppress(Exception):
            started.compose("down", "-v", "--remove-orphans")


async def turn(http: httpx.AsyncClient, sid: str, content: str) -> dict[str, Any]:
    response = await http.post(f"/api/sessions/{sid}/messages", json={"content": content})
    assert response.status_code == 200, response.text
    return dict(response.json())


async def session(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    return dict((await http.get(f"/api/sessions/{sid}")).json())


async def until(check: Any, timeout_s: float = 60) -> None:
    """Poll an async condition (the stack is only reachable over its ports)."""
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110 - a condition over HTTP, no event to wait on
            await asyncio.sleep(0.25)


@pytest.mark.compose
@pytest.mark.timeout(900)  # a first run builds the Debian base image (~3 min)
async def test_the_stack_runs_heals_and_keeps_its_history(stack: Stack) -> None:
    stack.compose("up", "-d", "--scale", "generator=2")
    stack.wait_healthy()
    async with gateway_client(stack.base_url, timeout=60) as http:
        sid = await converse_with_streaming(http)
        await compact_automatically_and_by_hand(http)
        killed = await kill_a_generator_mid_answer(stack, http, sid)
        before = await session(http, sid)
        started = {c: stack.inspect(c)["State"]["StartedAt"]  # type: ignore[index]
                   for c in stack.containers()
                   if c not in stack.containers("nats") and c != killed}
        stack.compose("restart", "nats")
        await until(lambda: _answers_as_before(http, sid, before))  # history intact
        stack.wait_healthy()
        for container, at in started.items():  # healed without a restart of their own
            assert stack.inspect(container)["State"]["StartedAt"] == at  # type: ignore[index]
        await turn(http, sid, "after the NATS restart")
    logs = stack.compose("logs", "--no-color")
    # Every service as its own NATS user (nats-users.conf) did all of this unrefused.
    assert "Violation" not in logs and "nats_permission_denied" not in logs, logs[-4000:]
    stack.compose("down")
    stack.compose("up", "-d")
    stack.wait_healthy()
    async with gateway_client(stack.base_url, timeout=60) as http:
        kept = await session(http, sid)
        assert [m["content"] for m in kept["messages"]][-2:-1] == ["after the NATS restart"]
    stack.compose("down", "-v")
    assert stack.containers() == [] and stack.volumes() == []


async def converse_with_streaming(http: httpx.AsyncClient) -> str:
    sid = str((await http.post("/api/sessions", json={})).json()["session_id"])
    async with http.stream("POST", f"/api/sessions/{sid}/messages",
                           json={"content": "hello over compose"},
                           headers={"Accept": "text/event-stream"}) as response:
        events = [event async for event in server_sent_events(response)]
    names = [name for name, _ in events]
    assert names[-1] == "done" and "token" in names, names
    assert events[-1][1]["reply"] == "Echo: hello over compose (turn 1)"
    assert (await turn(http, sid, "and again"))["reply"] == "Echo: and again (turn 2)"
    return sid


async def compact_automatically_and_by_hand(http: httpx.AsyncClient) -> None:
    sid = str((await http.post("/api/sessions", json={})).json()["session_id"])
    for i in range(12):
        await turn(http, sid, f"question {i} !long 1200")
    await until(lambda: _compactions_at_least(http, sid, 1))
    # By hand on a session the decider leaves alone: on the one above, a compaction it
    # asked for after the last long turns may still be under way, or have done the work.
    manual = str((await http.post("/api/sessions", json={"auto_compact": False})
                  ).json()["session_id"])
    for i in range(3):
        await turn(http, manual, f"question {i} !long 1200")
    for i in range(4):  # the tail a compaction keeps
        await turn(http, manual, f"short {i}")
    result = await compacted_by_hand(http, manual)
    assert result["status"] == "completed", f"{result['status']}: {result['error']}"
    assert (await session(http, manual))["compactions"] == 1


async def compacted_by_hand(http: httpx.AsyncClient, sid: str) -> dict[str, Any]:
    """Ask for a compaction of `sid`; its result, as the page's live feed shows it."""
    async with http.stream("GET", "/api/events", params={"session_id": sid}) as feed:
        lines = feed.aiter_lines()
        while await anext(lines) != ": connected":  # subscribed: nothing after is missed
            pass
        accepted = await http.post(f"/api/sessions/{sid}/compact")
        assert accepted.status_code == 202, accepted.text
        async with asyncio.timeout(60):
            async for name, event in server_sent_lines(lines):
                if name == "compaction.result" and not event["payload"]["auto"]:
                    return dict(event["payload"])
    raise AssertionError("the live feed ended before the compaction's result")


async def _answers_as_before(http: httpx.AsyncClient, sid: str, before: dict[str, Any]
                             ) -> bool:
    """False while NATS is still coming back; then the session must be as it was
    (but for when its last state was entered: the states live in memory, and
    a session reads idle, unstamped, after a restart of NATS)."""
    response = await http.get(f"/api/sessions/{sid}")
    if response.status_code != 200:
        return False
    assert _unstamped(response.json()) == _unstamped(before)
    return True


def _unstamped(session: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in session.items() if k not in ("state_at", "state_by")}


async def _compactions_at_least(http: httpx.AsyncClient, sid: str, count: int) -> bool:
    return int((await session(http, sid))["compactions"]) >= count


async def kill_a_generator_mid_answer(stack: Stack, http: httpx.AsyncClient, sid: str) -> str:
    """The stand-in holds the model's answer; the generator holding the
    session's lock is killed; the other one answers, exactly once."""
    await configure_stub(stack.stand_in_url, held_models=["stub-model"])
    asking = asyncio.create_task(turn(http, sid, "answered by the survivor"))
    holder = await lock_holder(stack.nats_url, sid)
    victim = next(c for c in stack.containers("generator") if holder.startswith(c[:12]))
    await asyncio.to_thread(subprocess.run, ["docker", "kill", victim], check=True,
                            capture_output=True)
    await configure_stub(stack.stand_in_url, held_models=[])
    reply = await asking
    assert reply["reply"].startswith("Echo: answered by the survivor")
    users = [m["content"] for m in (await session(http, sid))["messages"] if m["role"] == "user"]
    assert users.count("answered by the survivor") == 1
    return victim


async def lock_holder(nats_url: str, sid: str) -> str:
    """The generator id holding the session's lock, once one does."""
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(subjects.LOCKS_BUCKET)
        async with asyncio.timeout(30):
            while True:
                with contextlib.suppress(Exception):
                    value = json.loads((await kv.get(sid)).value or b"{}")
                    if "holder" in value:
                        return str(value["holder"])
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


