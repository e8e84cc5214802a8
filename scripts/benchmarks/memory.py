"""Row memory_sessions: the services' peak resident memory once many sessions
have been touched with one short turn each, and how much each session adds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.benchmarks.client import Http, ask_ok, http_client, new_session
from scripts.benchmarks.harness import Env, Row, Target, running_env
from tests.system import System

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

# Sessions touched with one short turn each, in batches.
MEMORY_SESSIONS = (400, 2000)  # quick, full
MEMORY_FIRST_SESSIONS = 200
MEMORY_BATCH = 50
GENERATOR_MAX_RSS_MB = 150.0


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


# Row memory_export: one long session exported whole, in both forms.
EXPORT_TURNS = (300, 2000)  # quick, full
EXPORT_QUESTION_CHARS = 6000


async def export_peaks(env: Env, turns: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """Transcript bytes, and the gateway's peak RSS (KB) before and after
    exporting it as Markdown and as JSON."""
    async with http_client(env, 2) as http:
        sid = await new_session(http)
        for turn in range(turns):
            await ask_ok(http, sid, f"question {turn} " + "x" * EXPORT_QUESTION_CHARS)
        before = peak_rss_kb(env.system)
        sizes = {form: len((await http.get(f"/api/sessions/{sid}/export?format={form}")).text)
                 for form in ("markdown", "json")}
    return sizes["markdown"], before, peak_rss_kb(env.system)


def row_memory_export(bench: Bench) -> Row:
    turns = EXPORT_TURNS[0] if bench.params.quick else EXPORT_TURNS[1]
    with running_env() as env:  # a fresh system: its peaks are this row's alone
        size, before, after = asyncio.run(export_peaks(env, turns))
    grown_mb = (after["gateway"] - before["gateway"]) / 1024
    return Row(
        name="memory_export", value=grown_mb, unit="MB (gateway peak RSS growth)",
        target=None,
        detail=f"a session of {turns:,} turns ({size / 1e6:.1f} MB of Markdown) exported as "
               f"Markdown and as JSON: the gateway's peak RSS {before['gateway'] / 1024:.0f} "
               f"→ {after['gateway'] / 1024:.0f} MB",
        raw={"turns": turns, "markdown_bytes": size, "peak_rss_kb_before": before,
             "peak_rss_kb_after": after},
    )
