"""Row turn_keyed: what an `Idempotency-Key` costs a turn. The gateway reads
the session's history before it sends a keyed question (an answer stored
already is returned instead), so a keyed turn waits for that read too.

The same system's turns with a key and without, session by session in turn,
the order swapped every round (`interleaved_turns`), so a spell of the
machine falls on both alike. No target: a figure for whoever decides whether
a client should send a key with every message."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from schemas.envelope import new_id
from scripts.benchmarks.client import ask, http_client, new_session
from scripts.benchmarks.harness import Env, Params, Row
from scripts.benchmarks.measure import started_processes, summary_ms
from scripts.benchmarks.round_trips import Side, interleaved_turns, product_side

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench


async def keyed_and_plain(env: Env, params: Params) -> tuple[Side, Side]:
    ours = started_processes()
    async with http_client(env, 4) as http:
        plain = product_side("plain", http, ours)
        keyed = Side("keyed", lambda: new_session(http),
                     lambda sid, content: ask(http, sid, content, key=new_id()), ours)
        await interleaved_turns(params, plain, keyed)
    return keyed, plain


def row_turn_keyed(bench: Bench) -> Row:
    keyed, plain = asyncio.run(keyed_and_plain(bench.plain(), bench.params))
    latency = {side.name: summary_ms(side.samples) for side in (keyed, plain)}
    cpu = {side.name: side.cpu_per_turn()["cpu_ms_per_unit"] for side in (keyed, plain)}
    return Row(
        name="turn_keyed", value=latency["keyed"]["p50_ms"] / latency["plain"]["p50_ms"],
        unit="× a turn without a key (p50)", target=None,
        detail=f"turn p50 {latency['keyed']['p50_ms']:.2f} against "
               f"{latency['plain']['p50_ms']:.2f} ms, p99 {latency['keyed']['p99_ms']:.2f} "
               f"against {latency['plain']['p99_ms']:.2f} ms; CPU {cpu['keyed']:.2f} against "
               f"{cpu['plain']:.2f} ms a turn over every process ({len(keyed.samples)} turns each)",
        raw={"latency": latency, "cpu_ms_per_turn": cpu},
    )
