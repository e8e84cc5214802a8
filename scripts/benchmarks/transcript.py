"""Row transcript_overhead: a session's first turn with a long transcript behind
a small context against one with a short transcript, so the time a turn takes
does not grow with history a compaction has already folded away."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import nats

from schemas import subjects
from schemas.history import ChatMessage, HistoryEntry, Snapshot
from scripts.benchmarks.client import http_client, new_session, timed_ask
from scripts.benchmarks.harness import Env, Params, Row, Target
from scripts.benchmarks.measure import summary_ms
from scripts.benchmarks.round_trips import measure_stub_chat
from services.shared.history_store import HistoryStore

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

TRANSCRIPT_MAX_RATIO = 1.2
LONG_TRANSCRIPT = 10_000
SHORT_TRANSCRIPT = 10


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


# Row transcript_last_page: a long session opened on the page, whose first
# request is its transcript's last page, against its first page.
LAST_PAGE_MAX_RATIO = 2.0
PAGE_ITEMS = 50  # the page's TRANSCRIPT_PAGE


async def page_times(env: Env, params: Params) -> dict[str, Any]:
    """p50 and p99 of asking for the first and for the last page of a
    session with LONG_TRANSCRIPT messages, taking turns."""
    requests = 20 if params.quick else 100
    samples: dict[str, list[float]] = {"first": [], "last": []}
    async with http_client(env, 1) as http:
        sid = await new_session(http)
        await write_transcript(env.nats_url, sid, LONG_TRANSCRIPT)
        queries = {"first": f"limit={PAGE_ITEMS}", "last": f"before=end&limit={PAGE_ITEMS}"}
        for _ in range(requests):
            for which, query in queries.items():
                started = time.perf_counter()
                response = await http.get(f"/api/sessions/{sid}/transcript?{query}")
                samples[which].append(time.perf_counter() - started)
                if response.status_code != 200 or len(response.json()["items"]) != PAGE_ITEMS:
                    raise RuntimeError(f"{which} page: HTTP {response.status_code}")
    return {which: summary_ms(times) for which, times in samples.items()}


def row_transcript_last_page(bench: Bench) -> Row:
    raw = asyncio.run(page_times(bench.plain(), bench.params))
    ratio = raw["last"]["p50_ms"] / raw["first"]["p50_ms"]
    return Row(
        name="transcript_last_page", value=ratio,
        unit=f"× the first page ({LONG_TRANSCRIPT:,} messages)",
        target=Target("<=", LAST_PAGE_MAX_RATIO),
        detail=f"{PAGE_ITEMS} items: the last page (what the page opens on) p50 "
               f"{raw['last']['p50_ms']:.1f} ms, p99 {raw['last']['p99_ms']:.1f} ms; the first "
               f"page p50 {raw['first']['p50_ms']:.1f} ms",
        raw=raw,
    )
