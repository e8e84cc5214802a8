"""Row turn_against: this checkout's product against another checkout's
(`--against PATH`, for example a git worktree of the commit before), their
turns interleaved session by session on one stand-in, as turn_overhead's are
against the floor's. A change worth a few percent is smaller than the spells
that move one run against the next; side by side, a spell falls on both.

    git worktree add ../before HEAD~1
    python scripts/bench.py --rows turn_against --against ../before
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from scripts.benchmarks.client import Http
from scripts.benchmarks.harness import Params, Row, past_first_seconds, running_env
from scripts.benchmarks.measure import started_processes, summary_ms
from scripts.benchmarks.round_trips import Side, interleaved_turns, product_side
from tests.stub_server import running_stub

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

# Three times turn_overhead's turns: a checkout against itself read 0.955-1.04
# in three runs of 400 turns each, 1.01-1.02 in three of 1,200.
AGAINST_TURNS_FACTOR = 3


async def timed_against(this_url: str, that_url: str, ours: frozenset[str],
                        theirs: frozenset[str], params: Params) -> tuple[Side, Side]:
    async with Http(this_url, 4) as http, Http(that_url, 4) as other:
        this, that = product_side("this", http, ours), product_side("that", other, theirs)
        await interleaved_turns(params, this, that)
    return this, that


def row_turn_against(bench: Bench) -> Row:
    """Both systems started alike, each on a server of its own, and timed only
    once both are past a generator's first seconds. (Without `--against` the
    row is skipped by `Bench.run`.)"""
    assert bench.against is not None
    with contextlib.ExitStack() as stack:
        stub = stack.enter_context(running_stub())
        before = started_processes()
        this = stack.enter_context(running_env(stub_url=stub))
        ours = started_processes() - before
        that = stack.enter_context(running_env(stub_url=stub, root=Path(bench.against)))
        theirs = started_processes() - before - ours
        past_first_seconds(that.started)
        shared = frozenset(key for key in before if key.startswith("ollama_stub:"))
        params = replace(bench.params, overhead_turns=AGAINST_TURNS_FACTOR
                         * bench.params.overhead_turns)
        sides = asyncio.run(timed_against(this.base_url, that.base_url, ours | shared,
                                          theirs | shared, params))
    return against_row(*sides, bench.against)


def against_row(this: Side, that: Side, against: str) -> Row:
    ours, theirs = summary_ms(this.samples), summary_ms(that.samples)
    cpu, their_cpu = this.cpu_per_turn(), that.cpu_per_turn()
    cpu_ratio = cpu["cpu_ms_per_unit"] / their_cpu["cpu_ms_per_unit"]
    return Row(
        name="turn_against", value=ours["p50_ms"] / theirs["p50_ms"],
        unit=f"× {Path(against).name}'s turn (p50)", target=None,
        detail=f"turn p50 {ours['p50_ms']:.2f} against {theirs['p50_ms']:.2f} ms, p99 "
               f"{ours['p99_ms']:.2f} against {theirs['p99_ms']:.2f} ms; CPU per answer "
               f"{cpu['cpu_ms_per_unit']:.2f} against {their_cpu['cpu_ms_per_unit']:.2f} ms "
               f"(×{cpu_ratio:.2f}); {ours['n']} turns each, interleaved",
        raw={"against": against, "turn": ours, "their_turn": theirs, "cpu_per_turn": cpu,
             "their_cpu_per_turn": their_cpu, "cpu_ratio": cpu_ratio},
    )
