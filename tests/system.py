"""The whole product as real processes against a real NATS and the Ollama
stand-in: what the end-to-end tests drive over HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import nats

from schemas import subjects
from services.shared.bus import round_trip
from tests.nats_server import free_port
from tests.processes import REPO_ROOT, ServiceProcess

SERVICE_MODULES = {
    "generator": "services.generator",
    "decider": "services.compaction_decider",
    "gateway": "services.gateway",
    "tools": "services.tools",
}


# The gateway refuses a write without this header, body or not (a cross-site
# form cannot send it), so every test client sends it on every request.
JSON_WRITES = {"Content-Type": "application/json"}


def gateway_client(base_url: str, timeout: float = 30.0,
                   headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, timeout=timeout,
                             headers={**JSON_WRITES, **(headers or {})})


class System:
    def __init__(self, nats_url: str, ollama_url: str, env: dict[str, str] | None = None,
                 services: tuple[str, ...] = ("generator", "decider", "gateway"),
                 root: Path = REPO_ROOT) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "NATS_URL": nats_url,
            "OLLAMA_HOST": ollama_url,
            "MODEL": "stub-model",
            "NUM_CTX": "8192",
            "GATEWAY_PORT": str(self.port),
            # Beaten every third of it: a stall under two thirds of it is no redelivery.
            "QUERY_ACK_WAIT_S": "6",
            "LOCK_LEASE_S": "6",
            **(env or {}),
        }
        self.root = root
        self.processes = {name: ServiceProcess(SERVICE_MODULES[name], self.env, root)
                          for name in services}

    def __getitem__(self, name: str) -> ServiceProcess:
        return self.processes[name]

    def start(self) -> System:
        try:
            for process in self.processes.values():
                process.start()
        except BaseException:
            self.stop()  # none left running by a start that failed half-way
            raise
        return self

    def stop(self) -> dict[str, int | None]:
        return {name: p.stop() for name, p in reversed(self.processes.items())}

    def add(self, name: str, module: str, env: dict[str, str] | None = None) -> ServiceProcess:
        process = ServiceProcess(module, {**self.env, **(env or {})}, self.root)
        self.processes[name] = process
        return process

    def client(self, timeout_s: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=JSON_WRITES)

    def http(self, timeout: float = 30.0) -> httpx.AsyncClient:
        return gateway_client(self.base_url, timeout)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {n}\n{p.log()[-tail:]}" for n, p in self.processes.items())


@contextmanager
def running_system(nats_url: str, ollama_url: str, env: dict[str, str] | None = None,
                   services: tuple[str, ...] = ("generator", "decider", "gateway"),
                   ) -> Iterator[System]:
    system = System(nats_url, ollama_url, env, services)
    try:
        yield system.start()
    finally:
        system.stop()


def new_session(client: httpx.Client, **body: object) -> str:
    response = client.post("/api/sessions", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["session_id"])


def ask(client: httpx.Client, sid: str, content: str) -> httpx.Response:
    return client.post(f"/api/sessions/{sid}/messages", json={"content": content})


def publish_now(nats_url: str, subject: str, data: bytes) -> None:
    """A core NATS message, as `nats pub` sends it; from any thread (see
    `put_live_setting`)."""
    async def publish() -> None:
        nc = await nats.connect(nats_url)
        try:
            await nc.publish(subject, data)
            await round_trip(nc)
        finally:
            await nc.close()

    _in_a_thread(publish())


def _in_a_thread(work: Coroutine[Any, Any, None]) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, work).result()


def put_live_setting(nats_url: str, key: str, value: bytes | None) -> None:
    """A setting put into the server's `config` bucket (None: deleted), as
    `nats kv put config <key> <value>` does. In a thread of its own, so that a
    test whose thread runs an event loop (Playwright's) may call it too."""
    async def put() -> None:
        nc = await nats.connect(nats_url)
        try:
            kv = await nc.jetstream().key_value(subjects.CONFIG_BUCKET)
            await (kv.put(key, value) if value is not None else kv.delete(key))
        finally:
            await nc.close()

    _in_a_thread(put())
