"""What a generator keeps per session to judge its provider's cached counts.

The part of a call a prompt cache may have served is read off the session's
history (`services.core.prompt_cache`), which every generator holds in its
bounded cache of recent views anyway; the turn runner itself keeps nothing
per session, where it once kept the last rendered prompt of up to 10,000
sessions (about 48 KB each at an 8k window)."""

from __future__ import annotations

from typing import Any

from services.generator.turns import RATE_FALL_KEPT, TurnRunner, _moved


def test_the_turn_runner_keeps_nothing_per_session() -> None:
    parts: list[Any] = [object() for _ in range(8)]
    runner = TurnRunner(*parts)
    kept = {name: value for name, value in vars(runner).items() if value not in parts}
    # `stops`: the switches of the turns running now, each gone when its turn ends.
    assert set(kept) == {"head_starts", "stops"}



def test_a_rate_that_rose_is_stored_and_one_that_fell_a_little_is_not() -> None:
    """A rate stored too low would let an estimate fall short of the truth, so
    any real rise is written; a small fall only leaves the estimate a little
    high, not worth a store and two messages a turn."""
    assert _moved(None, 0.25) and not _moved(0.25, None)
    assert _moved(0.25, 0.25 * 1.01)
    assert not _moved(0.25, 0.25 * 1.004)
    assert not _moved(0.25, 0.25 * (1 - RATE_FALL_KEPT / 2))
    assert _moved(0.25, 0.25 * (1 - RATE_FALL_KEPT * 1.5))
