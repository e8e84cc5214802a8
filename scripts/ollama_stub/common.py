"""Names shared by every part of the stand-in: JSON types, model names, canonical JSON,
and the two waiting helpers (sleep at least so long, first of several events)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any

JSONObject = dict[str, Any]
ChatMessage = dict[str, Any]
STUB_MODEL = "stub-model:latest"
STUB_VERSION = "0.0.0-stub"
# What Ollama (0.12.6 on) answers, with 400, a prompt too long for the window
# sent with "truncate": false.
TOO_LONG_TEXT = "the input length exceeds the context length"
# Events kept by `/_stub/slots` (arrivals, slots taken, first chunks, ends).
SLOT_LOG_LENGTH = 10_000
FIXED_TIMESTAMP = "2024-01-01T00:00:00Z"


def normalize_model(name: str) -> str:
    """Ollama treats an untagged model name as ``:latest``."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def canonical_json(value: Any) -> str:
    """Compact, key-sorted JSON, so equal structures always cost the same tokens."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


async def sleep_ns(seconds: float) -> int:
    """Sleep at least `seconds` (uvloop's millisecond timers may wake a little
    early) and return how long it was."""
    started = time.perf_counter_ns()
    if seconds > 0:
        await asyncio.sleep(seconds)
        short = started + int(seconds * 1e9) - time.perf_counter_ns()
        if short > 0:
            await asyncio.sleep(short / 1e9 + 0.001)
    return time.perf_counter_ns() - started


async def first_of(*awaitables: Awaitable[Any]) -> None:
    """Return when the first of these ends; the others are cancelled."""
    waiters = {asyncio.ensure_future(a) for a in awaitables}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
