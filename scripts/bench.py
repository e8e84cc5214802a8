"""Benchmark of the whole product: prints a table and writes the figures as JSON.

    python scripts/bench.py                 # every row (a few minutes)
    python scripts/bench.py --quick         # fewer repetitions (under a minute)
    python scripts/bench.py --rows splice_128k,estimate_error --json out.json
    python scripts/bench.py --in-process --rows splice_128k,estimate_error

Everything runs on this machine and is started here: a private nats-server,
the Ollama stand-in (scripts/ollama_stub.py) and the services as real
subprocesses (the classes of tests/system.py), driven over HTTP with aiohttp and
over NATS with nats-py. Figures are ratios measured in the same run (turn
overhead in NATS round trips, throughput as a share of the ideal, latency during
a compaction against latency without one), so they mean the same on a slow
and a fast machine. The rows turn_floor and throughput_floor measure the
same things on scripts/bare_turn.py, the hops a turn needs and nothing else,
as the reference the product's figures can be read against.

Speed is measured, not asserted: a missed target is reported (✗), and the exit
status is non-zero only when a row could not be measured at all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import httpx
import nats

from schemas import subjects
from schemas.envelope import Envelope, new_id
from schemas.history import ChatMessage, Conversation, HistoryEntry, Snapshot, ToolCall
from schemas.messages import GenerationReport
from scripts.ollama_stub import count_prompt_tokens, echo_reply, filler_text
from services.core.prompt import history_chars, render_messages, sent_chars
from services.core.prompt_cache import cached_size, previous_call
from services.core.splice import plan_compaction, splice
from services.core.text_size import prompt_size
from services.core.tokens import Calibration, calibrate, estimate_tokens
from services.generator.provider import ChatRequest, OllamaProvider
from services.shared.history_store import HistoryStore
from tests.nats_server import free_port, nats_server_binary, running_nats
from tests.processes import ServiceProcess
from tests.stub_server import running_stub
from tests.system import System

MODEL = "stub-model"
SUMMARISER = "summariser"
NUM_CTX = 8192
JSON_DEFAULT = "bench-results.json"
# The generators' shared durable consumer of the QUERIES stream.
QUERY_CONSUMER = "generator"

ROWS = (
    "nats_rtt",
    "turn_overhead",
    "turn_floor",
    "throughput_1_generator",
    "throughput_2_generators",
    "throughput_floor",
    "compaction_latency",
    "compaction_one_slot",
    "stop_latency",
    "splice_128k",
    "estimate_error",
    "transcript_overhead",
    "memory_sessions",
)
# Rows sharing the plain system run back to back, so it is started once and
# stopped before the compaction row starts systems of its own.
RUN_ORDER = (
    "nats_rtt",
    "turn_floor",
    "throughput_floor",
    "splice_128k",
    "turn_overhead",
    "throughput_1_generator",
    "throughput_2_generators",
    "estimate_error",
    "transcript_overhead",
    "compaction_latency",
    "compaction_one_slot",
    "stop_latency",
    "memory_sessions",
)
# Rows that cannot run without starting processes (see --in-process).
NEEDS_PROCESSES = frozenset(ROWS) - {"splice_128k", "estimate_error"}

# Targets: (comparison, bound).
TURN_OVERHEAD_MAX_RTTS = 8.0
THROUGHPUT_MIN_SHARE = 0.8
COMPACTION_MAX_RATIO = 1.2
ESTIMATE_MAX_ERROR_PCT = 5.0
TRANSCRIPT_MAX_RATIO = 1.2
LONG_TRANSCRIPT = 10_000
SHORT_TRANSCRIPT = 10

ANSWER_LATENCY_S = 0.2
SUMMARY_LATENCY_S = 5.0
# compaction_one_slot: answers and summaries from one model, whose time is
# per generated token, so a summary takes seconds and an answer a tenth of one.
SHARED_MS_PER_TOKEN = 10.0
SLOTS_COMPARED = (1, 4)
# The summariser's window there: small enough that the summary takes several pieces.
SHARED_SUMMARY_NUM_CTX = 1024
# A query during a blocking compaction slower than this counts as delayed.
DELAYED_S = 1.0
CHARS_PER_TOKEN = (2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
# stop_latency: from the stop asked for to the caller's `done`, over answers
# the stand-in writes slowly enough never to end by themselves meanwhile.
STOP_MAX_MS = 500.0
STOP_MS_PER_TOKEN = 5.0
STOP_ROUNDS = (5, 20)  # quick, full
STOP_AFTER_TOKENS = 3
# memory_sessions: sessions touched with one short turn each, in batches.
MEMORY_SESSIONS = (400, 2000)  # quick, full
MEMORY_FIRST_SESSIONS = 200
MEMORY_BATCH = 50
GENERATOR_MAX_RSS_MB = 150.0
# Turns answered while the splice's summary was written (they must all be kept).
MEANWHILE_TURNS = 3


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Params:
    quick: bool
    rtt_requests: int
    overhead_turns: int
    overhead_warmup: int
    turns_per_session: int
    stub_calls: int
    throughput_sessions: int
    throughput_settle_s: float
    throughput_window_s: float
    compaction_history_turns: int
    compaction_queries: int
    compaction_rounds: int
    compaction_tail_turns: int
    splice_reps: int
    splice_messages: int
    splice_chars: int
    estimate_turns: int


def params_for(quick: bool) -> Params:
    return Params(
        quick=quick,
        rtt_requests=2000,
        overhead_turns=100 if quick else 400,
        overhead_warmup=10 if quick else 20,
        turns_per_session=20,
        stub_calls=100 if quick else 400,
        throughput_sessions=64,
        throughput_settle_s=0.5 if quick else 1.0,
        throughput_window_s=1.0 if quick else 3.0,
        compaction_history_turns=12,
        compaction_queries=10 if quick else 20,
        compaction_rounds=1 if quick else 5,
        compaction_tail_turns=2,
        splice_reps=10 if quick else 50,
        splice_messages=400,
        splice_chars=512_000,
        estimate_turns=4 if quick else len(ESTIMATE_SCRIPT),
    )


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Target:
    op: str  # "<=" or ">="
    bound: float

    def met(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def text(self) -> str:
        return f"{'≤' if self.op == '<=' else '≥'} {format_number(self.bound)}"


@dataclass
class Row:
    name: str
    value: float | None
    unit: str
    target: Target | None
    detail: str
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None

    @property
    def meets_target(self) -> bool | None:
        if self.target is None or self.value is None:
            return None
        return self.target.met(self.value)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": None if self.target is None
            else {"op": self.target.op, "value": self.target.bound},
            "meets_target": self.meets_target,
            "detail": self.detail,
            "error": self.error,
            "skipped": self.skipped,
            "raw": self.raw,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01:
        return f"{value:.3g}"
    return f"{value:.2e}"


# --------------------------------------------------------------------------- processes


@dataclass
class Env:
    """One private nats-server, one stand-in, and the services on them."""

    nats_url: str
    stub_url: str
    system: System

    @property
    def base_url(self) -> str:
        return self.system.base_url


@contextlib.contextmanager
def running_env(stub_flags: Sequence[str] = (), env: dict[str, str] | None = None,
                services: tuple[str, ...] = ("generator", "decider", "gateway"),
                ) -> Iterator[Env]:
    with running_nats() as server, running_stub(*stub_flags) as stub:
        system = System(server.url, stub, env, services)
        try:
            system.start()
            yield Env(server.url, stub, system)
        except BaseException:
            print(f"service logs (tail):\n{system.logs()}", file=sys.stderr)
            raise
        finally:
            system.stop()
            for process in system.processes.values():
                process.log_path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Answer:
    """An HTTP response, read whole."""

    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class Http:
    """The driver's HTTP client: aiohttp, whose CPU per request is a fraction of
    httpx's. The driver shares the machine's cores with what it measures, so
    every millisecond it spends is one the services do not get."""

    def __init__(self, base_url: str, connections: int) -> None:
        self._session = aiohttp.ClientSession(
            base_url=base_url, timeout=aiohttp.ClientTimeout(total=120.0),
            connector=aiohttp.TCPConnector(limit=connections))

    async def __aenter__(self) -> Http:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def get(self, path: str) -> Answer:
        async with self._session.get(path) as response:
            return Answer(response.status, await response.text())

    async def post(self, path: str, json: Any = None) -> Answer:
        # The gateway refuses a write without a JSON content type, body or not.
        async with self._session.post(path, json=json,
                                      headers={"Content-Type": "application/json"}) as response:
            return Answer(response.status, await response.text())


def http_client(env: Env, connections: int = 32) -> Http:
    return Http(env.base_url, connections)


async def configure_stub(stub_url: str, **config: Any) -> None:
    async with Http(stub_url, 1) as client:
        answer = await client.post("/_stub/config", json=config)
    if answer.status_code != 200:
        raise RuntimeError(f"configuring the stand-in: HTTP {answer.status_code} {answer.text}")


async def new_session(http: Http, system: str = "") -> str:
    response = await http.post("/api/sessions", json={"system": system})
    if response.status_code != 201:
        raise RuntimeError(f"creating a session: HTTP {response.status_code} {response.text}")
    return str(response.json()["session_id"])


async def ask(http: Http, sid: str, content: str) -> Answer:
    return await http.post(f"/api/sessions/{sid}/messages", json={"content": content})


async def ask_ok(http: Http, sid: str, content: str) -> dict[str, Any]:
    response = await ask(http, sid, content)
    if response.status_code != 200:
        raise RuntimeError(f"query failed: HTTP {response.status_code} {response.text}")
    body: dict[str, Any] = response.json()
    return body


async def timed_ask(http: Http, sid: str, content: str
                    ) -> tuple[float, float, Answer]:
    """(start, seconds, response) of one query, start on the perf_counter clock."""
    started = time.perf_counter()
    response = await ask(http, sid, content)
    return started, time.perf_counter() - started, response


def cpu_seconds() -> dict[str, float]:
    """CPU time (user + system) so far of this process and of each process it started,
    keyed "what:pid" (Linux /proc; empty elsewhere)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {f"bench:{os.getpid()}": usage.ru_utime + usage.ru_stime}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The command name in parentheses may hold spaces: fields start after it.
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) != os.getpid():
            continue
        out[f"{process_label(argv)}:{stat.parent.name}"] = (
            int(fields[11]) + int(fields[12])) / tick
    return out


def process_label(argv: Sequence[bytes]) -> str:
    words = [a.decode(errors="replace") for a in argv if a]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1].rsplit(".", 1)[-1]
    return Path(words[0]).name if words else "?"


def cpu_per_unit(before: dict[str, float], after: dict[str, float], units: int,
                 wall_s: float) -> dict[str, Any]:
    """CPU milliseconds per unit of work by process, and how busy the cores were."""
    used = {key: after[key] - before.get(key, 0.0) for key in after}
    labels = [key.split(":")[0] for key in used]
    per_unit = {}
    for key, seconds in sorted(used.items()):
        label = key.split(":")[0]
        name = label if labels.count(label) == 1 else key
        per_unit[name] = seconds * 1000 / units
    total = sum(used.values())
    return {
        "cpu_ms_per_unit_by_process": per_unit,
        "cpu_ms_per_unit": total * 1000 / units,
        "cores_busy": total / wall_s,
        "cores": os.cpu_count(),
    }


# --------------------------------------------------------------------------- 1. nats_rtt


async def echo_responder(nats_url: str, ready: Callable[[], None]) -> None:
    """Answer every request on bench.rtt with its own payload, until cancelled."""
    responder = await nats.connect(nats_url)
    try:
        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await responder.subscribe("bench.rtt", cb=echo)
        await responder.flush()
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
    process = subprocess.Popen([sys.executable, __file__, "--echo-responder", nats_url],
                               stdout=subprocess.PIPE)
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
        await requester.flush()
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


async def sequential_turns(params: Params, new_session: Callable[[], Awaitable[str]],
                           ask_one: Callable[[str, str], Awaitable[Answer]]
                           ) -> tuple[list[float], dict[str, Any]]:
    """Latencies of one query after the other, a fresh session every
    `turns_per_session`, after a warm-up; and the CPU the measured turns cost."""
    samples: list[float] = []
    cpu_before: dict[str, float] = {}
    started = 0.0
    per_session = params.turns_per_session
    sid = ""
    for index in range(params.overhead_warmup + params.overhead_turns):
        if index == params.overhead_warmup:
            cpu_before, started = cpu_seconds(), time.perf_counter()
        if index % per_session == 0:
            sid = await new_session()
        sent = time.perf_counter()
        response = await ask_one(sid, f"benchmark question {index % per_session}")
        seconds = time.perf_counter() - sent
        if response.status_code != 200:
            raise RuntimeError(f"turn failed: HTTP {response.status_code} {response.text}")
        if index >= params.overhead_warmup:
            samples.append(seconds)
    cpu = cpu_per_unit(cpu_before, cpu_seconds(), params.overhead_turns,
                       time.perf_counter() - started)
    return samples, cpu


async def measure_turns(env: Env, params: Params) -> tuple[list[float], dict[str, Any]]:
    """The product's JSON POST /messages, one after the other."""
    async with http_client(env, 4) as http:
        return await sequential_turns(params, lambda: new_session(http),
                                      lambda sid, content: ask(http, sid, content))


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


async def overhead_of(turns: list[float], stub_url: str, nats_url: str, params: Params,
                      round_trips: RoundTrips | None) -> Overhead:
    """Set measured turns against the stand-in's own time for a prompt like
    theirs, and against the round trips (measured here unless given)."""
    history = overhead_history(params.turns_per_session // 2)
    stub = await measure_stub_chat(stub_url, params.stub_calls, history)
    if round_trips is None:
        round_trips = await measure_round_trips(nats_url, params.rtt_requests)
    return Overhead(summary_ms(turns), summary_ms(stub), round_trips)


async def turn_overhead(env: Env, params: Params, round_trips: RoundTrips | None
                        ) -> tuple[Overhead, dict[str, Any]]:
    turns, cpu = await measure_turns(env, params)
    return await overhead_of(turns, env.stub_url, env.nats_url, params, round_trips), cpu


def row_turn_overhead(bench: Bench) -> Row:
    overhead, cpu = asyncio.run(turn_overhead(bench.plain(), bench.params, bench.round_trips))
    rtt_ms = overhead.rtt_ms
    between_ms = overhead.round_trips.between_processes_s * 1000
    return Row(
        name="turn_overhead", value=overhead.p50_ms / rtt_ms, unit="NATS round trips (p50)",
        target=Target("<=", TURN_OVERHEAD_MAX_RTTS),
        detail=f"{overhead.text()}; {overhead.p50_ms / between_ms:.1f} round trips "
               f"between two processes ({between_ms:.3f} ms)",
        raw={
            "overhead_p50_ms": overhead.p50_ms,
            "overhead_p99_ms": overhead.p99_ms,
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


# --------------------------------------------------------------------------- 2b. turn_floor


@contextlib.contextmanager
def running_bare_turn() -> Iterator[tuple[str, str, str]]:
    """The two processes of scripts/bare_turn.py on a server and stand-in of
    their own: (NATS URL, stand-in URL, HTTP base URL)."""
    with running_nats() as server, running_stub() as stub:
        port = free_port()
        env = {"NATS_URL": server.url, "OLLAMA_HOST": stub, "MODEL": MODEL,
               "BARE_PORT": str(port)}
        processes = [ServiceProcess("scripts.bare_turn", {**env, "BARE_ROLE": role})
                     for role in ("generator", "gateway")]
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


async def turn_floor(params: Params, round_trips: RoundTrips | None
                     ) -> tuple[Overhead, dict[str, Any]]:
    """`turn_overhead`'s queries through the bare hops."""
    with running_bare_turn() as (nats_url, stub_url, base_url):
        async with Http(base_url, 4) as http:
            turns, cpu = await sequential_turns(params, bare_session, bare_ask(http))
        return await overhead_of(turns, stub_url, nats_url, params, round_trips), cpu


def row_turn_floor(bench: Bench) -> Row:
    overhead, cpu = asyncio.run(turn_floor(bench.params, bench.round_trips))
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


# --------------------------------------------------------------------------- 3-4. throughput


async def closed_loop(post: Callable[[Http, int], Awaitable[Answer]],
                      clients: Sequence[Http], settle_s: float, window_s: float
                      ) -> dict[str, Any]:
    """Every client sends requests one after the other, all clients at once,
    until `settle_s + window_s` have passed; counted are the answers that come
    back within the window, after the settling time.

    That is the rate with every client busy. Sending a fixed number each and
    waiting for the last would also count the start, when all clients send
    at the same instant, and the end, when the clients done early sit idle
    while the slowest finish theirs. Latencies and CPU are the window's."""
    latencies: list[float] = []
    failures: list[str] = []
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    window_start, window_end = started + settle_s, started + settle_s + window_s
    cpu: dict[str, dict[str, float]] = {}

    async def one_user(client: Http) -> None:
        index = 0
        while time.perf_counter() < window_end:
            sent = time.perf_counter()
            response = await post(client, index)
            done = time.perf_counter()
            index += 1
            if not window_start <= done < window_end:
                continue
            if response.status_code == 200:
                latencies.append(done - sent)
            else:
                failures.append(f"HTTP {response.status_code}: {response.text[:200]}")

    def sample_cpu(name: str) -> None:
        cpu[name] = cpu_seconds()

    loop.call_at(loop.time() + settle_s, sample_cpu, "start")
    loop.call_at(loop.time() + settle_s + window_s, sample_cpu, "end")
    await asyncio.gather(*(one_user(client) for client in clients))
    cpu.setdefault("end", cpu_seconds())  # only if no pass came after the window
    return {"latencies": latencies, "failures": failures,
            "all_done_s": time.perf_counter() - started,
            "cpu": cpu_per_unit(cpu["start"], cpu["end"], max(1, len(latencies)), window_s)}


class GeneratorProbe:
    """What the generators themselves saw during a run: each turn's own duration (from
    `response.generation`), how many turns each generator began (from its published
    state transitions) and how often the QUERIES consumer delivered a query again."""

    def __init__(self) -> None:
        self.turn_ms: list[float] = []
        self.turns_by_generator: dict[str, int] = {}
        self.deliveries = 0
        self.new_queries = 0
        self.head_starts: dict[str, dict[str, int]] = {}

    async def on_report(self, msg: Any) -> None:
        self.turn_ms.append(float(json.loads(msg.data)["payload"]["duration_ms"]))

    async def on_state(self, msg: Any) -> None:
        change = json.loads(msg.data)["payload"]
        if change["action"] == "start_generation":
            generator = change["generator_id"]
            self.turns_by_generator[generator] = self.turns_by_generator.get(generator, 0) + 1

    def summary(self) -> dict[str, Any]:
        turn = summary_ms([ms / 1000 for ms in self.turn_ms]) if self.turn_ms else {}
        return {"generator_turn": turn, "query_deliveries": self.deliveries,
                "turns_by_generator": self.turns_by_generator,
                "queries": self.new_queries,
                "query_redeliveries": self.deliveries - self.new_queries,
                "head_starts": self.head_starts}



def kept_share(head_starts: dict[str, dict[str, int]]) -> float:
    """Of the head starts the generators made, the share kept."""
    kept = sum(counts["kept"] for counts in head_starts.values())
    made = kept + sum(counts["abandoned"] for counts in head_starts.values())
    return kept / made if made else math.nan


async def head_start_counts(nc: Any, generators: int) -> dict[str, dict[str, int]]:
    """Each generator's head starts kept and abandoned so far. All generator
    processes answer the same status subject (one of them at random), so ask
    until each has answered."""
    counts: dict[str, dict[str, int]] = {}
    for _ in range(20 * generators):
        if len(counts) == generators:
            break
        status = json.loads((await nc.request("generator.status", b"", timeout=2)).data)
        counts[status["generator_id"]] = status["head_starts"]
    return counts


@contextlib.asynccontextmanager
async def generator_probe(nats_url: str, generators: int) -> AsyncIterator[GeneratorProbe]:
    probe = GeneratorProbe()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        before = await js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
        heads_before = await head_start_counts(nc, generators)
        await nc.subscribe(subjects.RESPONSE_GENERATION, cb=probe.on_report)
        await nc.subscribe(f"{subjects.STATE_PREFIX}.*", cb=probe.on_state)
        await nc.flush()
        yield probe
        await asyncio.sleep(0.2)  # the last reports follow the last replies
        after = await js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
        probe.deliveries = after.delivered.consumer_seq - before.delivered.consumer_seq
        probe.new_queries = after.delivered.stream_seq - before.delivered.stream_seq
        probe.head_starts = {
            generator: {kind: counts[kind] - heads_before.get(generator, {}).get(kind, 0)
                        for kind in ("kept", "abandoned")}
            for generator, counts in (await head_start_counts(nc, generators)).items()}
    finally:
        await nc.close()


async def throughput(env: Env, sessions: int, settle_s: float, window_s: float,
                     generators: int) -> dict[str, Any]:
    """`sessions` users at once, each sending one query after the other (see
    `closed_loop` for what is counted).

    Each user has a client (and keep-alive connection) of its own, like a browser."""
    await configure_stub(env.stub_url, model_latency={MODEL: ANSWER_LATENCY_S * 1000})
    try:
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(http_client(env, 1))
                       for _ in range(sessions)]
            sids = await asyncio.gather(*(new_session(c) for c in clients))
            by_client = dict(zip((id(c) for c in clients), sids, strict=True))
            # One untimed query each, so every connection and session is warm.
            await asyncio.gather(*(ask_ok(c, by_client[id(c)], "warm-up") for c in clients))
            async with generator_probe(env.nats_url, generators) as probe:
                measured = await closed_loop(
                    lambda c, i: ask(c, by_client[id(c)], f"question {i}"), clients,
                    settle_s, window_s)
            measured["probe"] = probe.summary()
            # The same load straight at the stand-in: what this driver and the
            # stand-in reach on this machine with nothing in between.
            direct = [await stack.enter_async_context(Http(env.stub_url, 1))
                      for _ in range(sessions)]
            body = {"model": MODEL, "stream": False, "options": {"num_ctx": NUM_CTX},
                    "messages": [{"role": "user", "content": "question"}]}
            await asyncio.gather(*(c.post("/api/chat", json=body) for c in direct))
            ceiling = await closed_loop(lambda c, i: c.post("/api/chat", json=body),
                                        direct, settle_s, window_s)
    finally:
        await configure_stub(env.stub_url, model_latency={})
    measured["direct"] = ceiling
    return measured


def throughput_row(name: str, bench: Bench, generators: int) -> Row:
    env = bench.plain()
    params = bench.params
    measured = asyncio.run(throughput(env, params.throughput_sessions,
                                      params.throughput_settle_s, params.throughput_window_s,
                                      generators))
    window_s = params.throughput_window_s
    answers = len(measured["latencies"])
    rate = answers / window_s
    ideal = params.throughput_sessions / ANSWER_LATENCY_S
    share = rate / ideal
    latency = summary_ms(measured["latencies"]) if measured["latencies"] else {}
    direct = measured["direct"]
    direct_rate = max(1, len(direct["latencies"])) / window_s
    return Row(
        name=name, value=share, unit="× ideal", target=Target(">=", THROUGHPUT_MIN_SHARE),
        detail=f"{rate:.0f} answers/s of ideal {ideal:.0f} "
               f"({params.throughput_sessions} sessions, {window_s:g} s after "
               f"{params.throughput_settle_s:g} s, "
               f"{ANSWER_LATENCY_S * 1000:.0f} ms/answer, {generators} generator(s)); "
               f"latency p50 {latency.get('p50_ms', math.nan):.0f} ms, "
               f"p99 {latency.get('p99_ms', math.nan):.0f} ms; "
               f"{measured['cpu']['cpu_ms_per_unit']:.1f} ms CPU/answer, "
               f"{measured['cpu']['cores_busy']:.2f} of {os.cpu_count()} cores busy; "
               f"head starts kept {kept_share(measured['probe']['head_starts']):.1%}; "
               f"stand-in alone: {direct_rate:.0f}/s",
        raw={
            "answers": answers,
            "failures": len(measured["failures"]),
            "failure_examples": measured["failures"][:3],
            "all_done_s": measured["all_done_s"],
            "answers_per_s": rate,
            "ideal_answers_per_s": ideal,
            "sessions": params.throughput_sessions,
            "window_s": window_s,
            "settle_s": params.throughput_settle_s,
            "answer_latency_ms": ANSWER_LATENCY_S * 1000,
            "generators": generators,
            "latency": latency,
            "cpu_per_answer": measured["cpu"],
            "stand_in_alone": {
                "answers_per_s": direct_rate,
                "share_of_ideal": direct_rate / ideal,
                "failures": len(direct["failures"]),
                "latency": summary_ms(direct["latencies"]) if direct["latencies"] else {},
                "cpu_per_answer": direct["cpu"],
            },
            "share_of_stand_in_alone": rate / direct_rate,
            **measured["probe"],
        },
    )


async def bare_throughput(stub_url: str, base_url: str, params: Params) -> dict[str, Any]:
    """`throughput`'s load on the bare turn of scripts/bare_turn.py."""
    await configure_stub(stub_url, model_latency={MODEL: ANSWER_LATENCY_S * 1000})
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(Http(base_url, 1))
                   for _ in range(params.throughput_sessions)]
        sids = {id(client): new_id() for client in clients}
        await asyncio.gather(*(bare_ask(c)(sids[id(c)], "warm-up") for c in clients))
        return await closed_loop(
            lambda c, i: bare_ask(c)(sids[id(c)], f"question {i}"),
            clients, params.throughput_settle_s, params.throughput_window_s)


def row_throughput_floor(bench: Bench) -> Row:
    params = bench.params
    with running_bare_turn() as (_, stub_url, base_url):
        measured = asyncio.run(bare_throughput(stub_url, base_url, params))
    answers = len(measured["latencies"])
    rate = answers / params.throughput_window_s
    ideal = params.throughput_sessions / ANSWER_LATENCY_S
    latency = summary_ms(measured["latencies"]) if measured["latencies"] else {}
    return Row(
        name="throughput_floor", value=rate / ideal, unit="× ideal", target=None,
        detail=f"the bare turn of scripts/bare_turn.py under throughput_1_generator's load: "
               f"{rate:.0f} answers/s of ideal {ideal:.0f}; latency p50 "
               f"{latency.get('p50_ms', math.nan):.0f} ms; "
               f"{measured['cpu']['cpu_ms_per_unit']:.1f} ms CPU/answer",
        raw={"answers": answers, "failures": len(measured["failures"]),
             "failure_examples": measured["failures"][:3], "answers_per_s": rate,
             "ideal_answers_per_s": ideal, "latency": latency,
             "cpu_per_answer": measured["cpu"]},
    )


def row_throughput_1(bench: Bench) -> Row:
    return throughput_row("throughput_1_generator", bench, 1)


def row_throughput_2(bench: Bench) -> Row:
    system = bench.plain().system
    second = system.add("gen-b", "services.generator", {"GENERATOR_ID": "gen-b"})
    try:
        second.start()
        return throughput_row("throughput_2_generators", bench, 2)
    finally:
        second.stop()
        del system.processes["gen-b"]
        second.log_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- 5. compaction


@dataclass
class CompactionRun:
    baseline: list[float]
    during: list[tuple[float, float, int, str]]  # start, seconds, status, error code
    after: list[tuple[float, float, int, str]]
    compact_posted: float
    started_at: float | None
    result_at: float | None
    result: dict[str, Any] | None
    # A twin session that is never compacted, queried right after each measured query:
    # what the same moments cost without a compaction (other load on the machine
    # shows in both).
    twin_baseline: list[float]
    twin_during: list[float]


class CompactionWatch:
    """compaction.event / compaction.result of one session, with arrival times."""

    def __init__(self, sid: str) -> None:
        self.sid = sid
        self.started_at: float | None = None
        self.result_at: float | None = None
        self.result: dict[str, Any] | None = None
        self._changed = asyncio.Event()

    async def on_message(self, msg: Any) -> None:
        envelope = json.loads(msg.data)
        payload = envelope.get("payload", {})
        if payload.get("session_id") != self.sid:
            return
        if msg.subject == subjects.COMPACTION_EVENT and payload.get("event") == "started":
            self.started_at = self.started_at or time.perf_counter()
        elif msg.subject == subjects.COMPACTION_RESULT and self.result is None:
            self.result_at = time.perf_counter()
            self.result = payload
        self._changed.set()

    async def wait(self, done: Callable[[], bool], timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():
                self._changed.clear()
                await self._changed.wait()


def query_outcome(response: Answer) -> tuple[int, str]:
    if response.status_code == 200:
        return 200, ""
    try:
        code = str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        code = "?"
    return response.status_code, code


async def compaction_round(nc: Any, http: Http, params: Params
                           ) -> CompactionRun:
    """A session with some history; N queries without compaction; a compaction whose
    summary takes 5 s and, as soon as it has started, N more queries; then a query
    every 100 ms until the compaction's result arrives."""
    sid = await new_session(http, "You are a benchmark assistant.")
    twin = await new_session(http, "You are a benchmark assistant.")
    watch = CompactionWatch(sid)
    subs = [await nc.subscribe(subjects.COMPACTION_EVENT, cb=watch.on_message),
            await nc.subscribe(subjects.COMPACTION_RESULT, cb=watch.on_message)]
    await nc.flush()

    async def twin_query(content: str) -> float:
        _, seconds, response = await timed_ask(http, twin, content)
        if response.status_code != 200:
            raise RuntimeError(f"twin session query: HTTP {response.status_code}")
        return seconds

    try:
        for index in range(params.compaction_history_turns):
            for session in (sid, twin):
                await ask_ok(http, session, f"history turn {index}: "
                             + filler_text(200, index))
        baseline, twin_baseline = [], []
        for index in range(params.compaction_queries):
            _, seconds, response = await timed_ask(http, sid, f"baseline {index}")
            if response.status_code != 200:
                raise RuntimeError(f"baseline query: HTTP {response.status_code}")
            baseline.append(seconds)
            twin_baseline.append(await twin_query(f"baseline {index}"))
        posted = time.perf_counter()
        response = await http.post(f"/api/sessions/{sid}/compact")
        if response.status_code != 202:
            raise RuntimeError(f"compact: HTTP {response.status_code} {response.text}")
        await watch.wait(lambda: watch.started_at is not None or watch.result is not None,
                         15.0)
        during, twin_during = [], []
        for index in range(params.compaction_queries):
            start, seconds, response = await timed_ask(http, sid, f"during {index}")
            during.append((start, seconds, *query_outcome(response)))
            twin_during.append(await twin_query(f"during {index}"))
        after = []
        while watch.result is None and time.perf_counter() - posted < 60:
            start, seconds, response = await timed_ask(http, sid, "until done")
            after.append((start, seconds, *query_outcome(response)))
            await asyncio.sleep(0.1)
        await watch.wait(lambda: watch.result is not None, 60.0)
    finally:
        for sub in subs:
            await sub.unsubscribe()
    return CompactionRun(baseline, during, after, posted, watch.started_at, watch.result_at,
                         watch.result, twin_baseline, twin_during)


async def compaction_rounds(env: Env, params: Params, rounds: int) -> list[CompactionRun]:
    nc = await nats.connect(env.nats_url)
    try:
        async with http_client(env, 4) as http:
            return [await compaction_round(nc, http, params) for _ in range(rounds)]
    finally:
        await nc.close()


def compaction_env(params: Params, mode: str) -> dict[str, str]:
    return {
        "COMPACTION_MODEL": SUMMARISER,
        "COMPACTION_TAIL_TURNS": str(params.compaction_tail_turns),
        "COMPACTION_MODE": mode,
        "BLOCKING_QUERY_WAIT_S": "10",
        "SUMMARY_TIMEOUT_S": "60",
    }


def measure_compaction(params: Params, mode: str, rounds: int) -> list[CompactionRun]:
    flags = ("--model-latency", f"{SUMMARISER}={SUMMARY_LATENCY_S * 1000:.0f}")
    with running_env(flags, compaction_env(params, mode)) as env:
        return asyncio.run(compaction_rounds(env, params, rounds))


def describe_run(run: CompactionRun) -> dict[str, Any]:
    if run.result is None or run.result_at is None:
        return {"result_status": None}
    first_start = run.during[0][0]
    overlapping = sum(1 for start, seconds, _, _ in run.during
                      if start + seconds <= run.result_at)
    return {
        "result_status": run.result.get("status"),
        "result_error": run.result.get("error"),
        "tokens_before": run.result.get("tokens_before"),
        "tokens_after": run.result.get("tokens_after"),
        "compaction_started_after_post_s": None if run.started_at is None
        else run.started_at - run.compact_posted,
        "compaction_result_after_post_s": run.result_at - run.compact_posted,
        "result_after_first_measured_query_s": run.result_at - first_start,
        "measured_queries_finished_before_result": overlapping,
        "baseline": summary_ms(run.baseline),
        "during_compaction": summary_ms([s for _, s, _, _ in run.during]),
        "during_ms": [round(s * 1000, 2) for _, s, _, _ in run.during],
        "twin_baseline": summary_ms(run.twin_baseline),
        "twin_during_compaction": summary_ms(run.twin_during),
        "queries_until_done": len(run.after),
        "queries_until_done_latency": summary_ms([s for _, s, _, _ in run.after])
        if run.after else {},
    }


def check_background(run: CompactionRun, info: dict[str, Any]) -> None:
    """The measured queries really ran during a compaction that completed."""
    if info["result_status"] != "completed":
        raise RuntimeError(f"background compaction did not complete: {run.result}")
    if info["result_after_first_measured_query_s"] <= 0:
        raise RuntimeError("the compaction finished before the measured queries started")
    failed = [(status, code) for _, _, status, code in run.during if status != 200]
    if failed:
        raise RuntimeError(f"queries failed during the background compaction: {failed}")


def background_figures(runs: Sequence[CompactionRun]) -> dict[str, Any]:
    """Latency during background compactions against before them, and the same
    for the twin session that was not compacted, at the same moments."""
    rounds = [describe_run(run) for run in runs]
    for run, info in zip(runs, rounds, strict=True):
        check_background(run, info)
    base = summary_ms([s for run in runs for s in run.baseline])
    during = summary_ms([s for run in runs for _, s, _, _ in run.during])
    twin_base = summary_ms([s for run in runs for s in run.twin_baseline])
    twin_during = summary_ms([s for run in runs for s in run.twin_during])
    return {
        "p50_ratio": during["p50_ms"] / base["p50_ms"],
        "p99_ratio": during["p99_ms"] / base["p99_ms"],
        "baseline": base,
        "during_compaction": during,
        "overlapped": sum(info["measured_queries_finished_before_result"] for info in rounds),
        "background_rounds": rounds,
        "twin": {
            "p50_ratio": twin_during["p50_ms"] / twin_base["p50_ms"],
            "p99_ratio": twin_during["p99_ms"] / twin_base["p99_ms"],
            "baseline": twin_base,
            "during_compaction": twin_during,
            "compacting_vs_twin_p50_ratio": during["p50_ms"] / twin_during["p50_ms"],
            "compacting_vs_twin_p99_ratio": during["p99_ms"] / twin_during["p99_ms"],
        },
    }


def blocking_figures(run: CompactionRun) -> dict[str, Any]:
    """Queries during and after a blocking compaction: refused, delayed, slowest."""
    blocked = [*run.during, *run.after]
    return {
        "query_wait_s": 10,
        "queries": len(blocked),
        "rejected": sum(1 for _, _, status, _ in blocked if status != 200),
        "rejected_codes": sorted({code for _, _, status, code in blocked if status != 200}),
        "delayed": sum(1 for _, seconds, status, _ in blocked
                       if status == 200 and seconds > DELAYED_S),
        "delayed_threshold_s": DELAYED_S,
        "max_latency_s": max(seconds for _, seconds, _, _ in blocked),
        **describe_run(run),
    }


def row_compaction(bench: Bench) -> Row:
    params = bench.params
    runs = measure_compaction(params, "background", params.compaction_rounds)
    background = background_figures(runs)
    (blocking_run,) = measure_compaction(params, "blocking", 1)
    blocking = blocking_figures(blocking_run)
    base, during = background["baseline"], background["during_compaction"]
    twin = background["twin"]
    return Row(
        name="compaction_latency",
        value=max(background["p50_ratio"], background["p99_ratio"]),
        unit="× no compaction (worse of p50, p99)", target=Target("<=", COMPACTION_MAX_RATIO),
        detail=f"background: p50 {during['p50_ms']:.1f} vs {base['p50_ms']:.1f} ms "
               f"(×{background['p50_ratio']:.2f}), p99 {during['p99_ms']:.1f} vs "
               f"{base['p99_ms']:.1f} ms (×{background['p99_ratio']:.2f}), "
               f"{background['overlapped']}/{during['n']} done before the "
               f"{SUMMARY_LATENCY_S:g} s summaries ended ({len(runs)} compaction(s)); "
               f"twin session without compaction, same moments: p50 ×{twin['p50_ratio']:.2f}, "
               f"p99 ×{twin['p99_ratio']:.2f}; "
               f"blocking: {blocking['rejected']} rejected, {blocking['delayed']} delayed > "
               f"{DELAYED_S:g} s of {blocking['queries']}, "
               f"max {blocking['max_latency_s']:.2f} s",
        raw={
            **{key: value for key, value in background.items() if key != "overlapped"},
            "summary_latency_s": SUMMARY_LATENCY_S,
            "history_turns": params.compaction_history_turns,
            "queries_per_phase": params.compaction_queries,
            "tail_turns": params.compaction_tail_turns,
            "blocking": blocking,
        },
    )


def measure_shared_slots(params: Params, parallel: int
                         ) -> tuple[list[CompactionRun], list[float]]:
    """Background compactions written in pieces by the model that answers, on
    a server serving `parallel` requests of it at once (OLLAMA_NUM_PARALLEL);
    with how long each piece held its slot (from the stand-in's slot log)."""
    flags = ("--parallel", str(parallel), "--ms-per-token", f"{SHARED_MS_PER_TOKEN:g}")
    env = {k: v for k, v in compaction_env(params, "background").items()
           if k != "COMPACTION_MODEL"}
    env["COMPACTION_NUM_CTX"] = str(SHARED_SUMMARY_NUM_CTX)
    with running_env(flags, env) as running:
        runs = asyncio.run(compaction_rounds(running, params, 1))
        log = httpx.get(f"{running.stub_url}/_stub/slots").json()["log"]
    return runs, summary_piece_seconds(log)


def summary_piece_seconds(log: Sequence[dict[str, Any]]) -> list[float]:
    """Slot time of each summary piece: summaries go one at a time per model,
    so each summary's slot is given back before the next one takes it."""
    taken, pieces = None, []
    for entry in log:
        if entry["kind"] != "summary":
            continue
        if entry["event"] == "started":
            taken = entry["at_s"]
        elif entry["event"] == "done" and taken is not None:
            pieces.append(entry["at_s"] - taken)
            taken = None
    return pieces


def shared_slot_figures(parallel: int, params: Params) -> dict[str, Any]:
    runs, pieces = measure_shared_slots(params, parallel)
    figures = background_figures(runs)
    if len(pieces) < 2:
        raise RuntimeError(f"the summary took {len(pieces)} piece(s), not several")
    base, during = figures["baseline"], figures["during_compaction"]
    piece_ms = 1000 * statistics.median(pieces)
    bound_ms = COMPACTION_MAX_RATIO * base["p50_ms"] + piece_ms
    return {**figures, "pieces": len(pieces), "piece_ms": piece_ms,
            "longest_piece_ms": 1000 * max(pieces), "p50_bound_ms": bound_ms,
            # What the slowest answer waited beyond a usual one: one piece at most.
            "longest_wait_ms": during["max_ms"] - base["p50_ms"],
            "p50_of_bound": during["p50_ms"] / bound_ms}


def row_compaction_one_slot(bench: Bench) -> Row:
    figures = {parallel: shared_slot_figures(parallel, bench.params)
               for parallel in SLOTS_COMPARED}
    one = figures[1]

    def text(parallel: int) -> str:
        f = figures[parallel]
        return (f"--parallel {parallel}: p50 {f['during_compaction']['p50_ms']:.0f} vs "
                f"{f['baseline']['p50_ms']:.0f} ms (×{f['p50_ratio']:.2f}), p99 "
                f"{f['during_compaction']['p99_ms']:.0f} vs {f['baseline']['p99_ms']:.0f} ms "
                f"(×{f['p99_ratio']:.2f}), longest {f['during_compaction']['max_ms']:.0f} ms "
                f"(waited {f['longest_wait_ms']:.0f}); "
                f"{f['pieces']} pieces of {f['piece_ms']:.0f} ms "
                f"(longest {f['longest_piece_ms']:.0f})")

    return Row(
        name="compaction_one_slot",
        value=one["p50_of_bound"],
        unit="of 1.2 × p50 without compaction + one piece (p50, --parallel 1)",
        target=Target("<=", 1.0),
        detail="; ".join(text(parallel) for parallel in SLOTS_COMPARED)
               + "; summaries by the answering model",
        raw={"ms_per_token": SHARED_MS_PER_TOKEN, "summary_num_ctx": SHARED_SUMMARY_NUM_CTX,
             **{f"parallel_{parallel}": f for parallel, f in figures.items()}},
    )


# --------------------------------------------------------------------------- 6. splice_128k


def big_history(messages: int, target_chars: int) -> Conversation:
    """`messages` messages of about `target_chars` characters as sent: turns of user +
    assistant, every other one with a tool call and its result in between."""

    def build(scale: float) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        turn = 0
        while len(out) < messages:
            out.append(ChatMessage(role="user", content=f"request {turn}: "
                                   + filler_text(round(450 * scale), turn)))
            if turn % 2 == 0 and len(out) + 3 <= messages:
                call = ToolCall(name="read_file", arguments={"path": f"src/module_{turn}.py"})
                out.append(ChatMessage(role="assistant", content="Let me look at the file.",
                                       tool_calls=(call,)))
                out.append(ChatMessage(role="tool", tool_name="read_file",
                                       content=filler_text(round(2800 * scale), turn + 1)))
            if len(out) < messages:
                out.append(ChatMessage(role="assistant", content=f"answer {turn}: "
                                       + filler_text(round(1950 * scale), turn + 2)))
            turn += 1
        return out

    first = build(1.0)
    scaled = build(target_chars / history_chars(first))
    return Conversation(messages=tuple(scaled))


def as_read_back(conversation: Conversation, extra_turns: int) -> Conversation:
    """The history as the splice finds it: read back from the store (equal, not the same
    objects) with the turns answered while the summary was being written."""
    copy = Conversation.model_validate_json(conversation.model_dump_json())
    for index in range(extra_turns):
        copy = copy.apply(HistoryEntry.of_turn((
            ChatMessage(role="user", content=f"meanwhile {index}"),
            ChatMessage(role="assistant", content=f"Echo: meanwhile {index}"))))
    return copy


def splice_once(snapshot: Conversation, current: Conversation, system: str, summary: str,
                tail_turns: int) -> tuple[float, float, int, int]:
    """(splice seconds, serialise seconds, rollup JSON bytes, chars sent after)."""
    started = time.perf_counter()
    plan = plan_compaction(snapshot, tail_turns)
    if plan is None:
        raise RuntimeError("nothing to compact in the benchmark history")
    rollup = splice(current, plan, summary)
    after = Conversation(summary=rollup.summary, messages=rollup.messages,
                         compactions=rollup.compactions)
    chars = sent_chars(render_messages(system, after))
    spliced = time.perf_counter()
    data = HistoryEntry.of_snapshot(rollup).model_dump_json().encode()
    serialised = time.perf_counter()
    return spliced - started, serialised - spliced, len(data), chars


def row_splice(bench: Bench) -> Row:
    params = bench.params
    conversation = big_history(params.splice_messages, params.splice_chars)
    system = "You are a careful coding assistant. " * 10
    summary = "Goal: refactor the parser.\n" + filler_text(3900, 3)
    tail = 4  # the generator's default COMPACTION_TAIL_TURNS
    splice_s: list[float] = []
    serialise_s: list[float] = []
    rollup_bytes = chars_after = 0
    current = as_read_back(conversation, MEANWHILE_TURNS)
    for _ in range(params.splice_reps):
        one, two, rollup_bytes, chars_after = splice_once(conversation, current, system,
                                                          summary, tail)
        splice_s.append(one)
        serialise_s.append(two)
    # For contrast: the pure work on the whole 128k history that a compaction
    # also does (its token estimate before), and a rollup that kept everything.
    render_full_s: list[float] = []
    for _ in range(params.splice_reps):
        started = time.perf_counter()
        sent_chars(render_messages(system, conversation))
        render_full_s.append(time.perf_counter() - started)
    started = time.perf_counter()
    whole = HistoryEntry.of_turn(conversation.messages).model_dump_json().encode()
    whole_s = time.perf_counter() - started
    chars_before = sent_chars(render_messages(system, conversation))
    splice_stats = summary_ms(splice_s)
    serialise_stats = summary_ms(serialise_s)
    return Row(
        name="splice_128k", value=splice_stats["p50_ms"], unit="ms (p50)", target=None,
        detail=f"plan+splice+render {splice_stats['p50_ms']:.2f} ms p50 "
               f"({len(conversation.messages)} msgs, {chars_before:,} chars ≈ "
               f"{chars_before // 4:,} tokens); rollup JSON {serialise_stats['p50_ms']:.3f} ms, "
               f"{rollup_bytes:,} B",
        raw={
            "splice": splice_stats,
            "serialise_rollup": serialise_stats,
            "rollup_json_bytes": rollup_bytes,
            "render_full_history": summary_ms(render_full_s),
            "whole_history_json_bytes": len(whole),
            "whole_history_serialise_ms": whole_s * 1000,
            "messages": len(conversation.messages),
            "tool_results": sum(1 for m in conversation.messages if m.role == "tool"),
            "history_chars_sent": chars_before,
            "approx_tokens_at_4_cpt": chars_before // 4,
            "chars_sent_after": chars_after,
            "tail_turns": tail,
            "turns_appended_during_summary": MEANWHILE_TURNS,
            "summary_chars": len(summary),
            "repetitions": params.splice_reps,
        },
    )


# --------------------------------------------------------------------------- 7. estimate_error

ESTIMATE_SYSTEM = "You are a patient gardening assistant. Answer briefly and concretely."
ESTIMATE_SCRIPT = (
    "Hello! Can you help me plan a small vegetable garden?",
    "I have about 20 square metres, partly shaded in the afternoon, clay soil. " * 4,
    "!long 1200 Tell me everything about growing tomatoes there.",
    "ok",
    "Here are my notes from last year: " + filler_text(1500, 11),
    "!long 400 And peppers?",
)


@dataclass(frozen=True)
class EstimatePoint:
    turn: int
    estimate: int
    actual: int

    @property
    def error_pct(self) -> float:
        return (self.estimate - self.actual) / self.actual * 100


def fit_check_estimate(system: str, conversation: Conversation, content: str,
                       calibration: Calibration) -> tuple[int, int]:
    """(tokens, chars) of the next prompt as the generator's fit check estimates it."""
    prompt = render_messages(system, conversation, [ChatMessage(role="user", content=content)])
    chars = sent_chars(prompt)
    return estimate_tokens(chars, calibration, len(prompt)), chars


def estimate_points_offline(cpt: float, script: Sequence[str]) -> list[EstimatePoint]:
    """The generator's estimate/calibrate loop emulated in-process, with the stand-in's
    tokenizer and reply rules as the provider."""
    conversation = Conversation()
    calibration = Calibration()
    points: list[EstimatePoint] = []
    for turn, content in enumerate(script, 1):
        user = ChatMessage(role="user", content=content)
        prompt = render_messages(ESTIMATE_SYSTEM, conversation, [user])
        size = prompt_size(prompt)
        estimate = estimate_tokens(size.chars, calibration, size.messages, size.extra_bytes)
        actual = count_prompt_tokens(prompt, None, cpt)
        if calibration.reports:
            points.append(EstimatePoint(turn, estimate, actual))
        # As the generator does: the part a prompt cache may have served, read
        # off the history, so a count of the rest alone is not taken for the whole.
        reused = cached_size(previous_call(ESTIMATE_SYSTEM, conversation), prompt)
        calibration = calibrate(calibration, actual, size.chars, NUM_CTX,
                                messages=size.messages, extra_bytes=size.extra_bytes,
                                reused_chars=reused.chars,
                                reused_extra_bytes=reused.extra_bytes,
                                reused_messages=reused.messages)
        answer = ChatMessage(role="assistant", content=echo_reply(prompt))
        conversation = conversation.apply(HistoryEntry.of_turn((user, answer)))
    return points


class ReportWatch:
    """response.generation reports, per session, in order."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[GenerationReport]] = {}

    def queue(self, sid: str) -> asyncio.Queue[GenerationReport]:
        return self._queues.setdefault(sid, asyncio.Queue())

    async def on_message(self, msg: Any) -> None:
        report = Envelope[GenerationReport].model_validate_json(msg.data).payload
        self.queue(report.session_id).put_nowait(report)


async def estimate_points_live(env: Env, http: Http, watch: ReportWatch,
                               cpt: float, script: Sequence[str]
                               ) -> tuple[list[EstimatePoint], dict[str, Any]]:
    """A session through the real system at `cpt` characters per token. Before each turn
    after the first: the generator's fit-check estimate of that turn's exact prompt, from
    the previous turn's provider report (pure functions); after it, the provider's count."""
    await configure_stub(env.stub_url, chars_per_token=cpt)
    sid = await new_session(http, ESTIMATE_SYSTEM)
    reports = watch.queue(sid)
    calibration = Calibration()
    pending: tuple[int, int] | None = None  # estimate, chars of the next prompt
    points: list[EstimatePoint] = []
    chars_mismatches = 0
    gateway_deltas: list[int] = []
    for turn, content in enumerate(script, 1):
        reply = await ask_ok(http, sid, content)
        report = await asyncio.wait_for(reports.get(), 15.0)
        actual = int(reply["prompt_tokens"])
        if report.prompt_tokens != actual:
            raise RuntimeError(f"report {report.prompt_tokens} != reply {actual} tokens")
        if pending is not None:
            points.append(EstimatePoint(turn, pending[0], actual))
            chars_mismatches += int(pending[1] != report.sent_chars)
        calibration = calibrate(calibration, report.prompt_tokens, report.sent_chars,
                                report.num_ctx, messages=report.sent_messages,
                                extra_bytes=report.sent_extra_bytes,
                                reused_chars=report.reused_chars,
                                reused_extra_bytes=report.reused_extra_bytes,
                                reused_messages=report.reused_messages)
        # The report comes after the generator stored its calibration: the gateway's
        # token_count is current now.
        session = (await http.get(f"/api/sessions/{sid}")).json()
        conversation = Conversation(
            summary=session["summary"], compactions=session["compactions"],
            messages=tuple(ChatMessage.model_validate(m) for m in session["messages"]))
        if report.next_prompt_chars is not None:
            own = estimate_tokens(report.next_prompt_chars, calibration,
                                  report.next_prompt_messages, report.next_prompt_extra_bytes)
            gateway_deltas.append(int(session["token_count"]) - own)
        pending = None
        if turn < len(script):
            pending = fit_check_estimate(ESTIMATE_SYSTEM, conversation, script[turn],
                                         calibration)
    return points, {"sent_chars_mismatches": chars_mismatches,
                    "gateway_token_count_minus_pure": gateway_deltas}


async def estimate_live(env: Env, script: Sequence[str]) -> dict[float, Any]:
    watch = ReportWatch()
    nc = await nats.connect(env.nats_url)
    results: dict[float, Any] = {}
    try:
        await nc.subscribe(subjects.RESPONSE_GENERATION, cb=watch.on_message)
        await nc.flush()
        async with http_client(env, 4) as http:
            for cpt in CHARS_PER_TOKEN:
                results[cpt] = await estimate_points_live(env, http, watch, cpt, script)
    finally:
        await configure_stub(env.stub_url, chars_per_token=4.0)
        await nc.close()
    return results


def row_estimate(bench: Bench) -> Row:
    script = ESTIMATE_SCRIPT[: bench.params.estimate_turns]
    offline = {cpt: estimate_points_offline(cpt, script) for cpt in CHARS_PER_TOKEN}
    if bench.in_process:
        mode = "in-process (stand-in tokenizer, no services)"
        points = offline
        checks: dict[str, Any] = {}
    else:
        mode = "live (gateway, generator, stand-in)"
        live = asyncio.run(estimate_live(bench.plain(), script))
        points = {cpt: live[cpt][0] for cpt in CHARS_PER_TOKEN}
        checks = {str(cpt): live[cpt][1] for cpt in CHARS_PER_TOKEN}
    # The error of largest size per chars/token, with its sign (+ over-estimates).
    signed = {cpt: max((p.error_pct for p in pts), key=abs) for cpt, pts in points.items()}
    per_cpt = {cpt: abs(err) for cpt, err in signed.items()}
    worst = max(per_cpt.values())
    return Row(
        name="estimate_error", value=worst, unit="% max |error|",
        target=Target("<=", ESTIMATE_MAX_ERROR_PCT),
        detail="worst per chars/token: " + ", ".join(f"{cpt:g}: {err:+.1f}%"
                                                     for cpt, err in signed.items())
               + f" ({len(script) - 1} estimates each, {mode.split(' ')[0]})",
        raw={
            "mode": mode,
            "max_abs_error_pct_by_cpt": {str(c): e for c, e in per_cpt.items()},
            "worst_signed_error_pct_by_cpt": {str(c): e for c, e in signed.items()},
            "max_underestimate_pct": -min(min(p.error_pct for p in pts) for pts in points.values()),
            "max_overestimate_pct": max(max(p.error_pct for p in pts) for pts in points.values()),
            "points_by_cpt": {str(c): [{"turn": p.turn, "estimate": p.estimate,
                                        "actual": p.actual, "error_pct": p.error_pct}
                                       for p in pts] for c, pts in points.items()},
            "offline_max_abs_error_pct_by_cpt": {
                str(c): max(abs(p.error_pct) for p in pts) for c, pts in offline.items()},
            "checks_by_cpt": checks,
            "turns": len(script),
        },
    )


# --------------------------------------------------------------------------- transcript_overhead


def transcript_turn(index: int) -> bytes:
    """A turn of old transcript: a 200-character question, an 800-character answer."""
    question = f"old question {index} " + "q" * 180
    answer = f"old answer {index} " + "a" * 780
    return HistoryEntry.of_turn((ChatMessage(role="user", content=question[:200]),
                                 ChatMessage(role="assistant", content=answer[:800]))
                                ).model_dump_json().encode()


async def write_transcript(nats_url: str, sid: str, messages: int) -> int:
    """`messages` messages of transcript, then a compaction's snapshot keeping
    the last turn, written straight to the stream. Returns the bytes the
    turns took on it."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        before = (await js.stream_info(subjects.HISTORY_STREAM)).state.bytes
        subject = subjects.history(sid)
        for first in range(0, messages // 2, 500):  # order within a batch does not matter
            await asyncio.gather(*(js.publish(subject, transcript_turn(i))
                                   for i in range(first, min(first + 500, messages // 2))))
        stored = (await js.stream_info(subjects.HISTORY_STREAM)).state.bytes - before
        store = HistoryStore(js)
        view = await store.read(sid)
        last = view.conversation.messages[-2:]
        await store.splice(sid, view, Snapshot(summary="Goal: the benchmark. " + "s" * 400,
                                                messages=last, compactions=1))
        return int(stored)
    finally:
        await nc.close()


async def transcript_overhead(env: Env, params: Params) -> dict[str, Any]:
    """First turns (a cold read of the context) on sessions with a long and a
    short transcript behind the same small context, interleaved in one run."""
    sessions = 3 if params.quick else 10
    async with http_client(env, 4) as http:
        kinds: dict[int, list[str]] = {LONG_TRANSCRIPT: [], SHORT_TRANSCRIPT: []}
        turn_bytes = 0
        for size, sids in kinds.items():
            for _ in range(sessions):
                sids.append(await new_session(http))
                written = await write_transcript(env.nats_url, sids[-1], size)
                turn_bytes = max(turn_bytes, written // (size // 2))
        samples: dict[int, list[float]] = {LONG_TRANSCRIPT: [], SHORT_TRANSCRIPT: []}
        for index in range(sessions):
            for size, sids in kinds.items():
                _, seconds, response = await timed_ask(http, sids[index], "benchmark question")
                if response.status_code != 200:
                    raise RuntimeError(f"turn failed: HTTP {response.status_code}")
                samples[size].append(seconds)
    prompt = [{"role": "system", "content": "summary " + "s" * 400},
              *({"role": r, "content": "x" * n} for r, n in (("user", 200), ("assistant", 800))),
              {"role": "user", "content": "benchmark question"}]
    stub = summary_ms(await measure_stub_chat(env.stub_url, params.stub_calls, prompt))
    return {"long": summary_ms(samples[LONG_TRANSCRIPT]),
            "short": summary_ms(samples[SHORT_TRANSCRIPT]), "stub": stub,
            "sessions_per_kind": sessions, "bytes_per_turn": turn_bytes}


def row_transcript_overhead(bench: Bench) -> Row:
    raw = asyncio.run(transcript_overhead(bench.plain(), bench.params))
    long_ms = raw["long"]["p50_ms"] - raw["stub"]["p50_ms"]
    short_ms = raw["short"]["p50_ms"] - raw["stub"]["p50_ms"]
    return Row(
        name="transcript_overhead", value=long_ms / short_ms,
        unit=f"× turn overhead ({LONG_TRANSCRIPT:,} vs {SHORT_TRANSCRIPT} messages)",
        target=Target("<=", TRANSCRIPT_MAX_RATIO),
        detail=f"first-turn overhead p50 {long_ms:.2f} ms with {LONG_TRANSCRIPT:,} messages "
               f"of transcript, {short_ms:.2f} ms with {SHORT_TRANSCRIPT}; "
               f"{raw['bytes_per_turn']:,} B stored per 1,000-character turn",
        raw={**raw, "long_overhead_ms": long_ms, "short_overhead_ms": short_ms},
    )


# --------------------------------------------------------------------------- stop


async def timed_stop(session: aiohttp.ClientSession, sid: str) -> float:
    """Seconds from asking to stop a streaming answer to its `done` event:
    by then the model call has ended, its HTTP stream closed, and the
    partial answer is stored."""
    tokens, asked = 0, 0.0
    event = ""
    async with session.post(f"/api/sessions/{sid}/messages",
                            json={"content": "go on !long 40000"},
                            headers={"accept": "text/event-stream"}) as response:
        async for raw in response.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                tokens += 1
                if tokens == STOP_AFTER_TOKENS:
                    asked = time.perf_counter()
                    async with session.post(f"/api/sessions/{sid}/stop") as stop:
                        if stop.status != 202:
                            raise RuntimeError(f"stop: HTTP {stop.status} {await stop.text()}")
            elif line.startswith("data: ") and event in ("done", "error"):
                if event != "done" or not asked or not json.loads(line[6:]).get("stopped"):
                    raise RuntimeError(f"the answer ended unstopped: {event} {line}")
                return time.perf_counter() - asked
    raise RuntimeError("the answer's stream ended without a done event")


async def timed_stops(env: Env, rounds: int) -> list[float]:
    timeout = aiohttp.ClientTimeout(total=120.0)
    async with aiohttp.ClientSession(base_url=env.base_url, timeout=timeout) as session:
        times = []
        for _ in range(rounds):
            async with session.post("/api/sessions", json={}) as created:
                sid = str((await created.json())["session_id"])
            times.append(await timed_stop(session, sid))
        return times


def row_stop_latency(bench: Bench) -> Row:
    rounds = STOP_ROUNDS[0] if bench.params.quick else STOP_ROUNDS[1]
    with running_env(("--ms-per-token", f"{STOP_MS_PER_TOKEN:g}")) as running:
        times = asyncio.run(timed_stops(running, rounds))
    figures = summary_ms(times)
    return Row(
        name="stop_latency", value=max(times) * 1000, unit="ms (max)",
        target=Target("<=", STOP_MAX_MS),
        detail=f"stop asked → done with the partial answer stored: p50 "
               f"{figures['p50_ms']:.1f} ms, p99 {figures['p99_ms']:.1f} ms over {len(times)} "
               f"stops, each after {STOP_AFTER_TOKENS} tokens",
        raw={**figures, "stops": len(times), "ms_per_token": STOP_MS_PER_TOKEN},
    )


# --------------------------------------------------------------------------- memory_sessions


def peak_rss_kb(system: System) -> dict[str, int]:
    """Peak resident set (VmHWM, KB) of each service process so far (Linux /proc)."""
    peaks = {}
    for name, process in system.processes.items():
        assert process.proc is not None
        status = Path(f"/proc/{process.proc.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
        peaks[name] = int(line.split()[1])
    return peaks


async def touch_sessions(http: Http, first: int, count: int) -> None:
    """Sessions first .. first+count-1: a new session and one short turn each,
    MEMORY_BATCH at a time (bounded, so the figure is sessions seen, not queued)."""
    async def touch(index: int) -> None:
        await ask_ok(http, await new_session(http), f"hello {index}")

    for start in range(first, first + count, MEMORY_BATCH):
        await asyncio.gather(*(touch(i) for i in range(start, min(start + MEMORY_BATCH,
                                                                    first + count))))


async def memory_with_sessions(env: Env, sessions: int) -> dict[str, dict[str, int]]:
    async with http_client(env, MEMORY_BATCH) as http:
        await touch_sessions(http, 0, MEMORY_FIRST_SESSIONS)
        early = peak_rss_kb(env.system)
        await touch_sessions(http, MEMORY_FIRST_SESSIONS, sessions - MEMORY_FIRST_SESSIONS)
    return {"early": early, "late": peak_rss_kb(env.system)}


def row_memory_sessions(bench: Bench) -> Row:
    sessions = MEMORY_SESSIONS[0] if bench.params.quick else MEMORY_SESSIONS[1]
    with running_env() as env:  # a fresh system: its peaks are this row's alone
        peaks = asyncio.run(memory_with_sessions(env, sessions))
    growth = {name: (peaks["late"][name] - kb) / (sessions - MEMORY_FIRST_SESSIONS)
              for name, kb in peaks["early"].items()}
    generator_mb = peaks["late"]["generator"] / 1024
    others = ", ".join(f"{name} {kb / 1024:.0f} MB" for name, kb in peaks["late"].items()
                       if name != "generator")
    return Row(
        name="memory_sessions", value=generator_mb,
        unit="MB (generator peak RSS)",
        target=Target("<=", GENERATOR_MAX_RSS_MB),
        detail=f"{sessions:,} sessions touched with one short turn each"
               f"{' (--quick; 2,000 without)' if bench.params.quick else ''}: generator "
               f"{peaks['early']['generator'] / 1024:.0f} MB after "
               f"{MEMORY_FIRST_SESSIONS}, {generator_mb:.0f} MB after {sessions:,}, "
               f"{growth['generator']:.1f} KB per session; {others}",
        raw={"sessions": sessions, "first_sessions": MEMORY_FIRST_SESSIONS,
             "batch": MEMORY_BATCH, "peak_rss_kb_after_first": peaks["early"],
             "peak_rss_kb_after_all": peaks["late"], "growth_kb_per_session": growth},
    )


# --------------------------------------------------------------------------- driver


RowFunction = Callable[["Bench"], Row]
ROW_FUNCTIONS: dict[str, RowFunction] = {
    "nats_rtt": row_nats_rtt,
    "turn_overhead": row_turn_overhead,
    "turn_floor": row_turn_floor,
    "throughput_floor": row_throughput_floor,
    "throughput_1_generator": row_throughput_1,
    "throughput_2_generators": row_throughput_2,
    "compaction_latency": row_compaction,
    "compaction_one_slot": row_compaction_one_slot,
    "stop_latency": row_stop_latency,
    "splice_128k": row_splice,
    "estimate_error": row_estimate,
    "transcript_overhead": row_transcript_overhead,
    "memory_sessions": row_memory_sessions,
}


class Bench:
    def __init__(self, params: Params, in_process: bool) -> None:
        self.params = params
        self.in_process = in_process
        self.round_trips: RoundTrips | None = None
        self._plain: Env | None = None
        self._plain_stack = contextlib.ExitStack()

    def plain(self) -> Env:
        """The system with default settings, started on first use."""
        if self._plain is None:
            self._plain = self._plain_stack.enter_context(running_env())
        return self._plain

    def close_plain(self) -> None:
        self._plain = None
        self._plain_stack.close()

    def run(self, name: str) -> Row:
        if self.in_process and name in NEEDS_PROCESSES:
            return Row(name=name, value=None, unit="", target=None, detail="skipped",
                       skipped="needs processes (--in-process)")
        if name in ("compaction_latency", "compaction_one_slot", "stop_latency"):
            self.close_plain()  # it starts systems of its own
        started = time.perf_counter()
        load = os.getloadavg()[0]
        # The driver's own garbage collector must not land in a timed query: a full
        # collection here took 260 ms once the earlier rows had left their cycles
        # behind. Collect before the row, none during it (like timeit).
        gc.collect()
        gc.disable()
        try:
            row = ROW_FUNCTIONS[name](self)
        except Exception as err:
            print(f"{name}: {type(err).__name__}: {err}", file=sys.stderr)
            return Row(name=name, value=None, unit="", target=None, detail="error",
                       error=f"{type(err).__name__}: {err}")
        finally:
            gc.enable()
        row.raw["row_seconds"] = time.perf_counter() - started
        # Other work on the machine shows here: a busy machine makes every figure noisier.
        row.raw["load_average_1m_before"] = load
        return row


def nats_server_version() -> str | None:
    try:
        out = subprocess.run([nats_server_binary(), "--version"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "nats_server": nats_server_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def finite(value: Any) -> Any:
    """The same structure with NaN and infinities as null, which JSON has no words for."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def table(rows: Sequence[Row]) -> str:
    header = ("row", "value", "unit", "target", "ok", "detail")
    lines = []
    for row in rows:
        if row.error is not None:
            ok, value = "ERROR", "—"
        elif row.skipped is not None:
            ok, value = "skipped", "—"
        else:
            ok = {True: "✓", False: "✗", None: "—"}[row.meets_target]
            value = "—" if row.value is None else format_number(row.value)
        detail = row.error or row.skipped or row.detail
        lines.append((row.name, value, row.unit, row.target.text() if row.target else "—",
                      ok, detail))
    widths = [max(len(str(line[i])) for line in (header, *lines)) for i in range(5)]

    def fmt(cells: Sequence[str]) -> str:
        first = "  ".join(str(c).ljust(w) for c, w in zip(cells[:5], widths, strict=True))
        return f"{first}  {cells[5]}"

    rule = "-" * (sum(widths) + 2 * 5 + 20)
    return "\n".join([fmt(header), rule, *(fmt(line) for line in lines)])


def parse_rows(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown row(s) {unknown or text!r}; known: {', '.join(ROWS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--json", default=JSON_DEFAULT, metavar="PATH",
                        help=f"where to write the results (default {JSON_DEFAULT})")
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS),
                        metavar="A,B", help="only these rows: " + ", ".join(ROWS))
    parser.add_argument("--in-process", action="store_true",
                        help="start no process: skip the rows that need NATS or the "
                             "services; estimate_error is emulated in-process")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wanted = set(args.rows)
    params = params_for(args.quick)
    bench = Bench(params, args.in_process)
    started = time.perf_counter()
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    results: dict[str, Row] = {}
    try:
        for name in RUN_ORDER:
            if name in wanted:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                results[name] = bench.run(name)
    finally:
        bench.close_plain()
    rows = [results[name] for name in ROWS if name in results]
    duration = time.perf_counter() - started
    document = {
        "timestamp": timestamp,
        "duration_s": duration,
        "quick": args.quick,
        "in_process": args.in_process,
        "machine": machine_info(),
        "rows": [row.as_json() for row in rows],
    }
    Path(args.json).write_text(json.dumps(finite(document), indent=2, allow_nan=False) + "\n")
    print(table(rows))
    print(f"\n{len(rows)} row(s) in {duration:.1f} s on {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; JSON written to {args.json}")
    return 1 if any(row.error is not None for row in rows) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--echo-responder"]:
        serve_echo(sys.argv[2])  # the responder of measure_nats_rtt_between_processes
    else:
        raise SystemExit(main())
