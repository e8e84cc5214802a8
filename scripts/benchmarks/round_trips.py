"""Rows nats_rtt, turn_overhead and turn_floor: a turn's time beyond the
stand-in's own, counted in NATS round trips measured in the same run, so the
figure means the same on a slow and a fast machine; turn_floor measures it on
scripts/bare_turn.py, the hops a turn needs and nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats

from schemas.envelope import new_id
from scripts.benchmarks.client import Answer, Http, ask, http_client, new_session
from scripts.benchmarks.harness import MODEL, NUM_CTX, Env, Params, Row, Target
from scripts.benchmarks.measure import (
    cpu_seconds,
    cpu_summary,
    cpu_used,
    percentile,
    started_processes,
    summary_ms,
)
from services.generator.provider import ChatRequest, OllamaProvider
from services.shared.bus import round_trip
from tests.nats_server import free_port, running_nats
from tests.processes import ServiceProcess
from tests.stub_server import running_stub

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

# Targets against the bare path measured in the same run (scripts/bare_turn.py):
# a turn's own overhead, and the CPU all processes spend on one answer.
TURN_OVERHEAD_MAX_FLOOR_RATIO = 1.25
TURN_CPU_MAX_FLOOR_RATIO = 1.5
# The entry point, which serves as the echo responder when run with
# --echo-responder.
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "bench.py"


# --------------------------------------------------------------------------- 1. nats_rtt


async def echo_responder(nats_url: str, ready: Callable[[], None]) -> None:
    """Answer every request on bench.rtt with its own payload, until cancelled."""
    responder = await nats.connect(nats_url)
    try:
        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await responder.subscribe("bench.rtt", cb=echo)
        await round_trip(responder)
        ready()
        await asyncio.Event().wait()
    finally:
        await responder.close()


@contextlib.asynccontextmanager
async def responder_in_this_process(nats_url: str) -> AsyncIterator[None]:
    ready = asyncio.Event()
    task = asyncio.create_task(echo_responder(nats_url, ready.set))
    try:
        await ready.wait()
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.contextmanager
def responder_in_a_process(nats_url: str) -> Iterator[None]:
    """The echo responder as a process of its own, like every service a turn crosses."""
    process = subprocess.Popen([sys.executable, str(BENCH_SCRIPT), "--echo-responder",
                                nats_url], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != b"ready":
            raise RuntimeError("the echo responder did not start")
        yield
    finally:
        process.kill()
        process.wait()


def serve_echo(nats_url: str) -> None:
    asyncio.run(echo_responder(nats_url, lambda: print("ready", flush=True)))


async def timed_requests(nats_url: str, requests: int, warmup: int) -> list[float]:
    """Sequential request/reply round trips through the server, loopback, 256-byte payload."""
    requester = await nats.connect(nats_url)
    try:
        # A request sent at once on a connection just opened was answered "no
        # responders" about once in thirty runs; one round trip first, never.
        await round_trip(requester)
        payload = b"x" * 256
        samples: list[float] = []
        for index in range(warmup + requests):
            started = time.perf_counter()
            await requester.request("bench.rtt", payload, timeout=5)
            if index >= warmup:
                samples.append(time.perf_counter() - started)
        return samples
    finally:
        await requester.close()


async def measure_nats_rtt(nats_url: str, requests: int, warmup: int = 200) -> list[float]:
    """Round trips to a responder on a second connection in this process: the
    unit the turn overhead is counted in."""
    async with responder_in_this_process(nats_url):
        return await timed_requests(nats_url, requests, warmup)


async def measure_nats_rtt_between_processes(nats_url: str, requests: int,
                                             warmup: int = 200) -> list[float]:
    """Round trips to a responder in a process of its own. Every hop of a turn
    goes from one process to another, which also wakes the other process."""
    with responder_in_a_process(nats_url):
        return await timed_requests(nats_url, requests, warmup)


@dataclass(frozen=True)
class RoundTrips:
    """Median NATS round trips the turn overhead is compared with."""

    same_process_s: float
    between_processes_s: float
    source: str


async def measure_round_trips(nats_url: str, requests: int) -> RoundTrips:
    same = await measure_nats_rtt(nats_url, requests)
    between = await measure_nats_rtt_between_processes(nats_url, requests)
    return RoundTrips(percentile(same, 50), percentile(between, 50),
                      "measured on this row's server")


def row_nats_rtt(bench: Bench) -> Row:
    with running_nats() as server:
        samples = asyncio.run(measure_nats_rtt(server.url, bench.params.rtt_requests))
        between = asyncio.run(measure_nats_rtt_between_processes(
            server.url, bench.params.rtt_requests))
    stats = summary_ms(samples)
    between_stats = summary_ms(between)
    bench.round_trips = RoundTrips(stats["p50_ms"] / 1000, between_stats["p50_ms"] / 1000,
                                   "nats_rtt row")
    return Row(
        name="nats_rtt", value=stats["p50_ms"], unit="ms (p50)", target=None,
        detail=f"p50 {stats['p50_ms']:.3f} ms, p99 {stats['p99_ms']:.3f} ms, "
               f"{stats['n']} requests; between two processes p50 "
               f"{between_stats['p50_ms']:.3f} ms",
        raw={**stats, "payload_bytes": 256, "between_processes": between_stats},
    )


# --------------------------------------------------------------------------- 2. turn_overhead


def overhead_history(turns: int) -> list[dict[str, Any]]:
    """A prompt like the ones turn_overhead sends halfway through a session."""
    messages: list[dict[str, Any]] = []
    for index in range(turns):
        messages.append({"role": "user", "content": f"benchmark question {index}"})
        messages.append({"role": "assistant",
                         "content": f"Echo: benchmark question {index} (turn {index + 1})"})
    messages.append({"role": "user", "content": f"benchmark question {turns}"})
    return messages


async def measure_stub_chat(stub_url: str, calls: int, messages: list[dict[str, Any]],
                            warmup: int = 10) -> list[float]:
    """The stand-in's own time for one chat call, made as the generator makes it
    for the measured turns (its provider, one whole answer, no token stream)."""
    provider = OllamaProvider(stub_url, timeout_s=30, connections=1)
    request = ChatRequest(model=MODEL, messages=messages, num_ctx=NUM_CTX)
    samples: list[float] = []
    try:
        for index in range(warmup + calls):
            started = time.perf_counter()
            await provider.chat(request)
            if index >= warmup:
                samples.append(time.perf_counter() - started)
    finally:
        await provider.close()
    return samples


@dataclass
class Side:
    """One of the two systems whose turns are timed against each other: how to
    start a session and ask in it, the processes that are its own (keys of
    `cpu_seconds`), and what its timed turns took."""

    name: str
    new_session: Callable[[], Awaitable[str]]
    ask_one: Callable[[str, str], Awaitable[Answer]]
    processes: frozenset[str]
    samples: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    async def session(self, turns: int, timed: bool) -> None:
        """A fresh session of `turns` queries, one after the other; timed, the
        latencies are kept and the CPU its own processes and the driver spent
        on it (the session's creation included) is added up."""
        before, started = cpu_seconds(), time.perf_counter()
        sid = await self.new_session()
        for index in range(turns):
            sent = time.perf_counter()
            response = await self.ask_one(sid, f"benchmark question {index}")
            seconds = time.perf_counter() - sent
            if response.status_code != 200:
                raise RuntimeError(f"{self.name} turn failed: HTTP {response.status_code} "
                                   f"{response.text}")
            if timed:
                self.samples.append(seconds)
        if timed:
            self.wall_s += time.perf_counter() - started
            for key, used in cpu_used(before, cpu_seconds()).items():
                if key in self.processes or key.startswith("bench:"):
                    self.cpu[key] = self.cpu.get(key, 0.0) + used

    def cpu_per_turn(self) -> dict[str, Any]:
        return cpu_summary(self.cpu, len(self.samples), self.wall_s)


def product_side(name: str, http: Http, processes: frozenset[str]) -> Side:
    """The product's turns through the gateway `http` reaches: a new session each."""
    return Side(name, lambda: new_session(http),
                lambda sid, content: ask(http, sid, content), processes)


async def interleaved_turns(params: Params, *sides: Side) -> None:
    """Every side's turns, a session each in turn, the order moved on by one
    every round (for two sides, swapped): a spell of the machine (another
    process busy, the CPU's clock moving) falls on all alike, so their ratios
    are the systems', not the moments they happened to run at."""
    per_session = params.turns_per_session
    warmup = -(-params.overhead_warmup // per_session)
    for side in sides:
        for _ in range(warmup):
            await side.session(per_session, timed=False)
    for round_index in range(-(-params.overhead_turns // per_session)):
        shift = round_index % len(sides)
        for side in sides[shift:] + sides[:shift]:
            await side.session(per_session, timed=True)


@dataclass(frozen=True)
class Overhead:
    """A turn's time beyond the stand-in's own, against NATS round trips."""

    turn: dict[str, float]
    stub: dict[str, float]
    round_trips: RoundTrips

    @property
    def rtt_ms(self) -> float:
        return self.round_trips.same_process_s * 1000

    @property
    def p50_ms(self) -> float:
        return self.turn["p50_ms"] - self.stub["p50_ms"]

    @property
    def p99_ms(self) -> float:
        return self.turn["p99_ms"] - self.stub["p50_ms"]

    def text(self) -> str:
        return (f"overhead p50 {self.p50_ms:.2f} ms, p99 {self.p99_ms:.2f} ms "
                f"(turn p50 {self.turn['p50_ms']:.2f} − stand-in "
                f"{self.stub['p50_ms']:.2f}); RTT {self.rtt_ms:.3f} ms")


# A side's turns: their overhead, and the CPU they cost by process.
Measured = tuple[Overhead, dict[str, Any]]


def measured_turns(bench: Bench) -> Measured:
    """turn_overhead's measurement (turn_cpu reads it too)."""
    return measured_sides(bench)["product"]


def measured_floor(bench: Bench) -> Measured:
    """turn_floor's measurement, made with the product's in the same minutes."""
    return measured_sides(bench)["floor"]


def measured_sides(bench: Bench) -> dict[str, Measured]:
    """The product's turns, the floor's and the contract floor's, interleaved
    on one stand-in (the stand-in's own time, taken off each, is then the same
    figure); measured once a run."""
    if bench.turn_sides is None:
        env = bench.plain()
        ours = started_processes()
        stub = frozenset(key for key in ours if key.startswith("ollama_stub:"))
        with running_bare_turn(env.stub_url) as (_, _, bare_url):
            bare = frozenset(cpu_seconds()) - ours
            with running_bare_turn(env.stub_url, contract=True) as (_, _, contract_url):
                contract = frozenset(cpu_seconds()) - ours - bare
                bench.turn_sides = asyncio.run(timed_sides(
                    env, {"floor": (bare_url, bare | stub),
                          "contract": (contract_url, contract | stub)},
                    ours, bench.params, bench.round_trips))
    return bench.turn_sides


async def timed_sides(env: Env, bare: dict[str, tuple[str, frozenset[str]]],
                      ours: frozenset[str], params: Params, round_trips: RoundTrips | None
                      ) -> dict[str, Measured]:
    """The product's turns and those of each bare turn in `bare` (by name: its
    HTTP address and its processes), interleaved."""
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(http_client(env, 4))
        sides = [product_side("product", http, ours)]
        for name, (url, processes) in bare.items():
            client = await stack.enter_async_context(Http(url, 4))
            sides.append(Side(name, bare_session, bare_ask(client), processes))
        await interleaved_turns(params, *sides)
    # The stand-in's own time for a prompt like theirs, and the round trips
    # the overhead is counted in (measured here unless the run has them).
    history = overhead_history(params.turns_per_session // 2)
    stub = summary_ms(await measure_stub_chat(env.stub_url, params.stub_calls, history))
    if round_trips is None:
        round_trips = await measure_round_trips(env.nats_url, params.rtt_requests)
    return {side.name: (Overhead(summary_ms(side.samples), stub, round_trips),
                        side.cpu_per_turn()) for side in sides}


def row_turn_overhead(bench: Bench) -> Row:
    overhead, cpu = measured_turns(bench)
    floor, _ = measured_floor(bench)
    rtt_ms = overhead.rtt_ms
    between_ms = overhead.round_trips.between_processes_s * 1000
    return Row(
        name="turn_overhead", value=overhead.p50_ms / floor.p50_ms, unit="× turn_floor (p50)",
        target=Target("<=", TURN_OVERHEAD_MAX_FLOOR_RATIO),
        detail=f"{overhead.text()}; floor {floor.p50_ms:.2f} ms; {overhead.p50_ms / rtt_ms:.1f}"
               f" round trips in one process, {overhead.p50_ms / between_ms:.1f} between two "
               f"({between_ms:.3f} ms)",
        raw={
            "overhead_p50_ms": overhead.p50_ms,
            "overhead_p99_ms": overhead.p99_ms,
            "floor_overhead_p50_ms": floor.p50_ms,
            "overhead_p50_rtts": overhead.p50_ms / rtt_ms,
            "overhead_p99_rtts": overhead.p99_ms / rtt_ms,
            "turn": overhead.turn,
            "stub_own_time": overhead.stub,
            "nats_rtt_p50_ms": rtt_ms,
            "nats_rtt_source": overhead.round_trips.source,
            "nats_rtt_between_processes_p50_ms": between_ms,
            "overhead_p50_rtts_between_processes": overhead.p50_ms / between_ms,
            "turns_per_session": bench.params.turns_per_session,
            "stub_prompt_messages": len(overhead_history(bench.params.turns_per_session // 2)),
            "services": list(bench.plain().system.processes),
            "cpu_per_turn": cpu,
        },
    )


def row_turn_cpu(bench: Bench) -> Row:
    _, cpu = measured_turns(bench)
    _, floor_cpu = measured_floor(bench)
    ours, bare = cpu["cpu_ms_per_unit"], floor_cpu["cpu_ms_per_unit"]
    return Row(
        name="turn_cpu", value=ours / bare, unit="× turn_floor (CPU per answer)",
        target=Target("<=", TURN_CPU_MAX_FLOOR_RATIO),
        detail=f"{ours:.2f} ms of CPU per answer over every process against the floor's "
               f"{bare:.2f} ms (turn_overhead's and turn_floor's turns)",
        raw={"cpu_ms_per_answer": ours, "floor_cpu_ms_per_answer": bare,
             "by_process": cpu["cpu_ms_per_unit_by_process"],
             "floor_by_process": floor_cpu["cpu_ms_per_unit_by_process"]},
    )


def row_turn_contract_floor(bench: Bench) -> Row:
    """The product against the floor that also sends the contract's messages:
    what its own code costs a turn beyond what the contract makes every turn
    pay. No target: evidence for where the turn targets can be set."""
    overhead, cpu = measured_turns(bench)
    contract, contract_cpu = measured_sides(bench)["contract"]
    floor, floor_cpu = measured_floor(bench)
    ours, theirs = cpu["cpu_ms_per_unit"], contract_cpu["cpu_ms_per_unit"]
    bare = floor_cpu["cpu_ms_per_unit"]
    return Row(
        name="turn_contract_floor", value=overhead.p50_ms / contract.p50_ms,
        unit="× contract floor (p50)", target=None,
        detail=f"the floor with the contract's messages (scripts/bare_turn.py, "
               f"BARE_CONTRACT=1): overhead p50 {contract.p50_ms:.2f} ms, "
               f"{contract.p50_ms / floor.p50_ms:.2f} × turn_floor's; CPU per answer "
               f"{theirs:.2f} ms, {theirs / bare:.2f} × the floor's; the product's CPU "
               f"{ours / theirs:.2f} × it",
        raw={"overhead_p50_ms": overhead.p50_ms, "contract_overhead_p50_ms": contract.p50_ms,
             "contract_overhead_p99_ms": contract.p99_ms,
             "floor_overhead_p50_ms": floor.p50_ms,
             "contract_over_floor": contract.p50_ms / floor.p50_ms,
             "cpu_ms_per_answer": ours, "contract_cpu_ms_per_answer": theirs,
             "floor_cpu_ms_per_answer": bare, "cpu_over_contract": ours / theirs,
             "contract_cpu_over_floor": theirs / bare,
             "contract_by_process": contract_cpu["cpu_ms_per_unit_by_process"]},
    )


# --------------------------------------------------------------------------- 2b. turn_floor


@contextlib.contextmanager
def running_bare_turn(stub_url: str | None = None, contract: bool = False,
                      prepare: Callable[[str, ServiceProcess], None] | None = None,
                      ) -> Iterator[tuple[str, str, str]]:
    """The processes of scripts/bare_turn.py on a server of their own and the
    stand-in at `stub_url` (else one of their own): (NATS URL, stand-in URL,
    HTTP base URL). `contract`: with the contract's messages, and the process
    that reads the reports. `prepare` is given each role's process before it
    starts (to run it profiled, say)."""
    with running_nats() as server, contextlib.ExitStack() as stack:
        stub = stub_url or stack.enter_context(running_stub())
        port = free_port()
        env = {"NATS_URL": server.url, "OLLAMA_HOST": stub, "MODEL": MODEL,
               "BARE_PORT": str(port), "BARE_CONTRACT": "1" if contract else "0"}
        roles = ("generator", "decider", "gateway") if contract else ("generator", "gateway")
        processes = [ServiceProcess("scripts.bare_turn", {**env, "BARE_ROLE": role})
                     for role in roles]
        if prepare is not None:
            for role, process in zip(roles, processes, strict=True):
                prepare(role, process)
        try:
            for process in processes:
                process.start()  # one after the other: both set up the streams
            yield server.url, stub, f"http://127.0.0.1:{port}"
        finally:
            for process in reversed(processes):
                process.stop()
                process.log_path.unlink(missing_ok=True)


async def bare_session() -> str:
    """The bare turn keeps no session records: any new id is a new session."""
    return new_id()


def bare_ask(http: Http) -> Callable[[str, str], Awaitable[Answer]]:
    """A query to the bare turn's gateway; its sessions need no creating."""
    return lambda sid, content: http.post(f"/q/{sid}", json={"content": content})


def row_turn_floor(bench: Bench) -> Row:
    overhead, cpu = measured_floor(bench)
    return Row(
        name="turn_floor", value=overhead.p50_ms / overhead.rtt_ms,
        unit="NATS round trips (p50)", target=None,
        detail=f"the hops a turn needs and nothing else (scripts/bare_turn.py): "
               f"{overhead.text()}",
        raw={
            "overhead_p50_ms": overhead.p50_ms,
            "overhead_p99_ms": overhead.p99_ms,
            "turn": overhead.turn,
            "stub_own_time": overhead.stub,
            "nats_rtt_p50_ms": overhead.rtt_ms,
            "nats_rtt_source": overhead.round_trips.source,
            "cpu_per_turn": cpu,
        },
    )
