"""Row turn_messages: how many messages one turn puts through the NATS server,
on the product and on the floor (scripts/bare_turn.py), by kind of subject.

A count, not a time: it does not move with the machine, and under load every
message is a wake-up of some process and a pass of its event loop, which is
where a turn's CPU beyond the floor goes (docs/performance.md)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from scripts.benchmarks.bus import watching_bus
from scripts.benchmarks.client import Http, ask, http_client, new_session
from scripts.benchmarks.harness import Env, Row
from scripts.benchmarks.round_trips import bare_ask, running_bare_turn

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

COUNTED_TURNS = 50
# Ids and inboxes folded, so that a subject names a kind of message.
_FOLDS = (
    (re.compile(r"_INBOX[^ ]*"), "_INBOX.*"),
    (re.compile(r"\$JS\.ACK\..*"), "$JS.ACK.*"),
    (re.compile(r"\$JS\.API\.(\w+\.\w+)\..*"), r"$JS.API.\1.*"),
    (re.compile(r"^(history|chat\.\w+|generator\.state|bare\.\w)\..*"), r"\1.<sid>"),
    (re.compile(r"^\$KV\.(\w+)\..*"), r"$KV.\1.<key>"),
)


def kind_of(subject: str) -> str:
    for pattern, replacement in _FOLDS:
        subject = pattern.sub(replacement, subject)
    return subject


async def counted(nats_url: str, ask_one: Callable[[str], Awaitable[object]]
                  ) -> Counter[str]:
    """Messages by kind over COUNTED_TURNS questions asked one after the
    other (after one not counted, which warms the session up), and until a
    round trip after them: what a turn sets off after its reply counts too."""
    await ask_one("warm-up")
    kinds: Counter[str] = Counter()

    async def count(msg: Msg) -> None:
        kinds[kind_of(msg.subject)] += 1

    async with watching_bus(nats_url, [">"], count):
        for index in range(COUNTED_TURNS):
            await ask_one(f"question {index}")
    return kinds


async def product_messages(env: Env) -> Counter[str]:
    async with http_client(env, 2) as http:
        sid = await new_session(http)
        return await counted(env.nats_url, lambda content: ask(http, sid, content))


async def floor_messages(nats_url: str, base_url: str) -> Counter[str]:
    async with Http(base_url, 2) as http:
        ask_bare = bare_ask(http)
        return await counted(nats_url, lambda content: ask_bare("counted", content))


def row_turn_messages(bench: Bench) -> Row:
    env = bench.plain()
    product = asyncio.run(product_messages(env))
    with running_bare_turn(env.stub_url) as (nats_url, _, base_url):
        floor = asyncio.run(floor_messages(nats_url, base_url))
    ours, bare = (sum(kinds.values()) / COUNTED_TURNS for kinds in (product, floor))

    def per_turn(kinds: Counter[str]) -> dict[str, float]:
        return {kind: count / COUNTED_TURNS for kind, count in kinds.most_common()}

    return Row(
        name="turn_messages", value=ours, unit="messages through NATS per turn", target=None,
        detail=f"{ours:.1f} against the floor's {bare:.1f} ({COUNTED_TURNS} turns of one "
               "session each, counted by a '>' subscriber)",
        raw={"product": per_turn(product), "floor": per_turn(floor), "floor_total": bare},
    )
