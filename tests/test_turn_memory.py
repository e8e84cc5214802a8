"""What a generator keeps per session to judge its provider's cached counts.

The part of a call a prompt cache may have served is read off the session's
history (`services.core.prompt_cache`), which every generator holds in its
bounded cache of recent views anyway; the turn runner itself keeps nothing
per session, where it once kept the last rendered prompt of up to 10,000
sessions (about 48 KB each at an 8k window)."""

from __future__ import annotations

from typing import Any

from services.generator.turns import TurnRunner


def test_the_turn_runner_keeps_nothing_per_session() -> None:
    parts: list[Any] = [object() for _ in range(8)]
    runner = TurnRunner(*parts)
    kept = {name: value for name, value in vars(runner).items() if value not in parts}
    # `stops`: the switches of the turns running now, each gone when its turn ends.
    assert set(kept) == {"head_starts", "stops"}

