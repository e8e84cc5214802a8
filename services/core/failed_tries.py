"""What becomes of a query whose attempt failed for no fault of the model's
(a model's failure is the caller's answer, not a failed attempt): it is
tried again in a moment, or its caller is told.

Three kinds of failure are told apart. A crash (most likely a bug) is tried
a few times. NATS not answering (a reconnect, or a stream electing its
leader, which takes seconds) is waited out for a while with growing pauses,
since the next try is likely to work, and counts as no crash. NATS refusing
a write for want of room is told at once: trying again makes no room."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from schemas.messages import ErrorCode

# After this many crashes of a query its caller gets `internal_error`.
MAX_CRASHES = 3
CRASH_PAUSE_S = 0.5
# Pauses between tries while NATS does not answer: the first, doubled each
# time, up to the longest.
FIRST_AWAY_PAUSE_S = 0.25
LONGEST_AWAY_PAUSE_S = 4.0
DOUBLINGS_TO_LONGEST = math.ceil(math.log2(LONGEST_AWAY_PAUSE_S / FIRST_AWAY_PAUSE_S))


class Failure(StrEnum):
    crash = "crash"
    nats_away = "nats_away"
    no_room = "no_room"


@dataclass(frozen=True)
class Tries:
    """A query's failed attempts so far."""

    crashes: int = 0
    # While NATS did not answer: how often, and since when (monotonic seconds).
    aways: int = 0
    away_since: float | None = None


@dataclass(frozen=True)
class TryAgain:
    after_s: float


@dataclass(frozen=True)
class GiveUp:
    code: ErrorCode  # internal_error, nats_unavailable or storage_full


def after_failure(tries: Tries, failure: Failure, now: float, patience_s: float
                  ) -> tuple[Tries, TryAgain | GiveUp]:
    """The query's tries with this failure counted, and what to do next.
    NATS is waited out while `patience_s` has not passed since it first
    failed this query."""
    if failure is Failure.no_room:
        return tries, GiveUp(ErrorCode.storage_full)
    if failure is Failure.crash:
        counted = replace(tries, crashes=tries.crashes + 1)
        if counted.crashes >= MAX_CRASHES:
            return counted, GiveUp(ErrorCode.internal_error)
        return counted, TryAgain(CRASH_PAUSE_S)
    since = now if tries.away_since is None else tries.away_since
    counted = replace(tries, aways=tries.aways + 1, away_since=since)
    if now - since >= patience_s:
        return counted, GiveUp(ErrorCode.nats_unavailable)
    # The doubling stops at the longest pause: a float power overflows after
    # about a thousand tries, which a patience of a day reaches.
    doublings = min(counted.aways - 1, DOUBLINGS_TO_LONGEST)
    pause = FIRST_AWAY_PAUSE_S * 2 ** doublings
    return counted, TryAgain(min(pause, LONGEST_AWAY_PAUSE_S))
