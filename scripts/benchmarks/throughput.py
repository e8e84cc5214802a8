"""Rows throughput_1_generator, throughput_2_generators and throughput_floor:
answers per second with many sessions busy at once, as a share of the ideal
the stand-in's fixed answer time allows, with what the generators saw meanwhile
(head starts kept, queries delivered again); throughput_floor puts the same
load on scripts/bare_turn.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import nats

from schemas import subjects
from schemas.envelope import new_id
from scripts.benchmarks.client import (
    Answer,
    Http,
    ask,
    ask_ok,
    configure_stub,
    http_client,
    new_session,
)
from scripts.benchmarks.harness import (
    MODEL,
    NUM_CTX,
    Env,
    Params,
    Row,
    Target,
    past_first_seconds,
)
from scripts.benchmarks.measure import cpu_per_unit, cpu_seconds, summary_ms
from scripts.benchmarks.round_trips import bare_ask, running_bare_turn

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

THROUGHPUT_MIN_SHARE = 0.9
ANSWER_LATENCY_S = 0.2
# The generators' shared durable consumer of the QUERIES stream.
QUERY_CONSUMER = "generator"
# How long the probe waits for the reports of the run's last turns.
REPORTS_WAIT_S = 5.0


def cpu_at_window(settle_s: float, window_s: float) -> dict[str, dict[str, float]]:
    """CPU so far (`cpu_seconds`) as the window starts ("start") and as it ends
    ("end"), filled in by the running loop at those moments."""
    loop = asyncio.get_running_loop()
    cpu: dict[str, dict[str, float]] = {}

    def sample_cpu(name: str) -> None:
        cpu[name] = cpu_seconds()

    loop.call_at(loop.time() + settle_s, sample_cpu, "start")
    loop.call_at(loop.time() + settle_s + window_s, sample_cpu, "end")
    return cpu


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
    started = time.perf_counter()
    window_start, window_end = started + settle_s, started + settle_s + window_s

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

    cpu = cpu_at_window(settle_s, window_s)
    await asyncio.gather(*(one_user(client) for client in clients))
    cpu.setdefault("end", cpu_seconds())  # only if no pass came after the window
    return {"latencies": latencies, "failures": failures,
            "all_done_s": time.perf_counter() - started,
            "cpu": cpu_per_unit(cpu["start"], cpu["end"], max(1, len(latencies)), window_s)}


class GeneratorProbe:
    """What the generators themselves saw during a run: each turn's own duration (from
    the `response.generation` reports), how many turns each generator answered and
    how often the QUERIES consumer delivered a query again.

    Nothing listens on the bus meanwhile: a subscriber to every state change and
    report would spend the two cores the product is measured on (the floor has
    none), so all of it is read before and after, from the generators' status
    and from the streams."""

    def __init__(self) -> None:
        self.turn_ms: list[float] = []
        self.turns_by_generator: dict[str, int] = {}
        self.deliveries = 0
        self.new_queries = 0
        self.head_starts: dict[str, dict[str, int]] = {}

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


async def generator_statuses(nc: Any, generators: int) -> dict[str, dict[str, Any]]:
    """Each generator's status, by its id. All generator processes answer the
    same status subject (one of them at random), so ask until each has answered."""
    statuses: dict[str, dict[str, Any]] = {}
    for _ in range(20 * generators):
        if len(statuses) == generators:
            break
        reply = await nc.request(subjects.service_status("generator"), b"", timeout=2)
        status = json.loads(reply.data)
        statuses[status["generator_id"]] = status
    return statuses


def status_changes(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
                   ) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Turns answered and head starts (kept, abandoned), by generator, between two readings."""
    answered, heads = {}, {}
    for generator, status in after.items():
        earlier = before.get(generator, {"answered": 0, "head_starts": {}})
        answered[generator] = status["answered"] - earlier["answered"]
        heads[generator] = {kind: status["head_starts"][kind]
                            - earlier["head_starts"].get(kind, 0)
                            for kind in ("kept", "abandoned")}
    return answered, heads


async def reported_turn_ms(js: Any, after_seq: int, expected: int) -> list[float]:
    """The `duration_ms` of the reports stored after `after_seq`: up to
    `expected` of them, waiting a little for the last, which follow their replies."""
    deadline = time.monotonic() + REPORTS_WAIT_S
    last = after_seq
    while time.monotonic() < deadline:
        last = (await js.stream_info(subjects.GENERATIONS_STREAM)).state.last_seq
        if last - after_seq >= expected:
            break
        await asyncio.sleep(0.05)
    durations = []
    for seq in range(after_seq + 1, last + 1):
        stored = await js.get_msg(subjects.GENERATIONS_STREAM, seq)
        durations.append(float(json.loads(stored.data)["payload"]["duration_ms"]))
    return durations


@contextlib.asynccontextmanager
async def generator_probe(nats_url: str, generators: int) -> AsyncIterator[GeneratorProbe]:
    probe = GeneratorProbe()
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        before = await js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
        statuses_before = await generator_statuses(nc, generators)
        reports_before = (await js.stream_info(subjects.GENERATIONS_STREAM)).state.last_seq
        yield probe
        after = await js.consumer_info(subjects.QUERIES_STREAM, QUERY_CONSUMER)
        probe.deliveries = after.delivered.consumer_seq - before.delivered.consumer_seq
        probe.new_queries = after.delivered.stream_seq - before.delivered.stream_seq
        probe.turns_by_generator, probe.head_starts = status_changes(
            statuses_before, await generator_statuses(nc, generators))
        probe.turn_ms = await reported_turn_ms(js, reports_before,
                                               sum(probe.turns_by_generator.values()))
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


def throughput_raw(measured: dict[str, Any], params: Params, generators: int, rate: float,
                   ideal: float, latency: dict[str, float], direct_rate: float
                   ) -> dict[str, Any]:
    """The raw figures of a throughput row, the stand-in alone's beside the product's."""
    answers = len(measured["latencies"])
    window_s = params.throughput_window_s
    direct = measured["direct"]
    return {
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
    }


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
        raw=throughput_raw(measured, params, generators, rate, ideal, latency, direct_rate),
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
        past_first_seconds(time.monotonic())  # two generators running, not one starting
        return throughput_row("throughput_2_generators", bench, 2)
    finally:
        second.stop()
        del system.processes["gen-b"]
        second.log_path.unlink(missing_ok=True)
