"""NATS not answering for a while: a reconnect, a stream electing its leader,
a stream not made again yet after a restart. Worth trying again in a
moment, not a fault of ours; `patiently` does so for a write that is safe to
repeat (a publish under a message id the stream keeps once, or a
compare-and-swap write, which a first try that landed turns into a
conflict)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from nats.errors import (
    ConnectionClosedError,
    ConnectionReconnectingError,
    NoRespondersError,
)
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from services.core.failed_tries import Failure, GiveUp, Tries, after_failure

log = structlog.get_logger()
T = TypeVar("T")

NATS_AWAY = (ConnectionReconnectingError, ConnectionClosedError, NoRespondersError,
             NatsTimeout, NoStreamResponseError, ServiceUnavailableError)


async def _pause(seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return False


async def patiently(attempt: Callable[[], Awaitable[T]], patience_s: float, event: str,
                    pause: Callable[[float], Awaitable[bool]] = _pause) -> T:
    """What `attempt` returns, tried again while NATS does not answer, after
    the pauses of `services.core.failed_tries`, for `patience_s`. Its last
    error once the patience is spent, or the connection closed for good, or
    `pause` returns True (the caller is stopping). Each try again is logged
    as `event`."""
    tries = Tries()
    while True:
        try:
            return await attempt()
        except NATS_AWAY as err:
            tries, outcome = after_failure(tries, Failure.nats_away, time.monotonic(),
                                           patience_s)
            if isinstance(outcome, GiveUp) or isinstance(err, ConnectionClosedError):
                raise
            log.warning(event, error=type(err).__name__, pause_s=outcome.after_s)
            if await pause(outcome.after_s):
                raise
