"""Row failover_after_kill: the generator writing an answer is killed outright
(SIGKILL: no hand-back), and the row times how long its caller waits until
another generator begins the answer again (the stream's `restart` event) and
until the answer ends. Run with the product's own QUERY_ACK_WAIT_S and lock
lease, not the tests' shorter ones: those two settings are the wait."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from scripts.benchmarks.client import Http, http_client, new_session
from scripts.benchmarks.harness import Env, Row, running_env
from services.generator.settings import GeneratorSettings
from services.shared.jetstream import DEFAULT_LOCK_LEASE_S

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

FAILOVER_ROUNDS = (1, 3)  # quick, full
MS_PER_TOKEN = 20.0
GENERATORS = ("gen-1", "gen-2")


def product_defaults() -> dict[str, str]:
    ack_wait = GeneratorSettings.model_fields["query_ack_wait_s"].default
    return {"QUERY_ACK_WAIT_S": f"{ack_wait:g}", "LOCK_LEASE_S": f"{DEFAULT_LOCK_LEASE_S:g}"}


def start_generator(env: Env, name: str) -> None:
    env.system.add(name, "services.generator", {"GENERATOR_ID": name}).start()


async def killed_mid_answer(env: Env, http: Http, sid: str) -> tuple[float, float, str]:
    """(seconds from the kill to the answer begun again, to its end, the generator killed)."""
    killed_at, restarted_at, killed = 0.0, 0.0, ""
    async with http.events(f"/api/sessions/{sid}/messages",
                           json={"content": "!long 400 go"}) as events:
        async for event, data in events:
            if event == "token" and not killed:
                killed = str((await http.get(f"/api/sessions/{sid}")).json()["state_by"])
                env.system[killed].kill()
                killed_at = time.perf_counter()
            elif event == "restart":
                restarted_at = time.perf_counter()
            elif event in ("done", "error"):
                if event != "done" or not restarted_at:
                    raise RuntimeError(f"the answer did not begin again: {event} {data}")
                return restarted_at - killed_at, time.perf_counter() - killed_at, killed
    raise RuntimeError("the answer's stream ended without a done event")


async def failovers(env: Env, rounds: int) -> list[tuple[float, float]]:
    times = []
    async with http_client(env, 4) as http:
        for _ in range(rounds):
            begun, ended, killed = await killed_mid_answer(env, http, await new_session(http))
            times.append((begun, ended))
            await asyncio.to_thread(start_generator, env, killed)  # as a supervisor would
    return times


def row_failover(bench: Bench) -> Row:
    rounds = FAILOVER_ROUNDS[0] if bench.params.quick else FAILOVER_ROUNDS[1]
    settings = product_defaults()
    with running_env(("--ms-per-token", f"{MS_PER_TOKEN:g}"), settings,
                     services=("gateway",)) as running:
        for name in GENERATORS:
            start_generator(running, name)
        times = asyncio.run(failovers(running, rounds))
    begun = sorted(t for t, _ in times)
    ended = sorted(t for _, t in times)
    return Row(
        name="failover_after_kill", value=begun[-1], unit="s (max)", target=None,
        detail=f"answer begun again after {', '.join(f'{t:.1f}' for t in begun)} s, ended after "
               f"{', '.join(f'{t:.1f}' for t in ended)} s; QUERY_ACK_WAIT_S "
               f"{settings['QUERY_ACK_WAIT_S']}, LOCK_LEASE_S {settings['LOCK_LEASE_S']}",
        raw={"begun_s": begun, "ended_s": ended, "rounds": rounds, **settings},
    )
