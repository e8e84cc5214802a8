"""Prometheus metrics of every service, through `prometheus-client`.

The gateway serves them at `/metrics` on its HTTP port; every other service
on `METRICS_PORT`, when set. Each service's group of metrics is registered
the first time it is asked for, so a process exposes only its own.

Labels are bounded sets only (error codes, levels, outcomes): never a
session id, a model name or anything a caller chooses, which would grow the
series without end.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from functools import cache

from nats.aio.client import Client as NATS
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from schemas.envelope import utc_now
from schemas.messages import ErrorCode

# Seconds: from a few milliseconds (a stand-in's answer) to a slow model.
TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Estimate / provider count: 1.0 is a perfect estimate.
RATIO_BUCKETS = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0)
# Error codes a reply may carry; anything else is counted as `other`, so a
# new code cannot grow the label set unnoticed.
KNOWN_ERROR_CODES = frozenset(code.value for code in ErrorCode)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def seconds_since(timestamp: datetime) -> float:
    """Wall-clock seconds since an envelope's timestamp (never negative: the
    sender's clock may be a little ahead)."""
    return max(0.0, (utc_now() - timestamp).total_seconds())


def error_label(code: str | None) -> str:
    if code is None:
        return "none"
    return code if code in KNOWN_ERROR_CODES else "other"


def seconds(name: str, documentation: str, labels: Sequence[str] = ()) -> Histogram:
    """A histogram of durations, all on the same buckets so they compare."""
    return Histogram(name, documentation, labels, buckets=TIME_BUCKETS)


class GeneratorMetrics:
    def __init__(self) -> None:
        self.turns = Counter("generator_turns", "Queries answered, by outcome and error code",
                             ["outcome", "error_code"])
        self.queue_wait = seconds("generator_queue_wait_seconds",
                                  "From a query's publish to its delivery here")
        self.lock_wait = seconds("generator_lock_wait_seconds",
                                 "From asking for a session's lock to holding it")
        self.model_time = seconds("generator_model_seconds", "One model call, whole",
                                  ["purpose"])
        self.first_token = seconds("generator_time_to_first_token_seconds",
                                   "From a streamed model call to its first token")
        self.turn_time = seconds("generator_turn_seconds",
                                 "From a query's publish to its reply (end to end)")
        self.compactions = Counter("generator_compactions",
                                   "Compaction results, by outcome, level and trigger",
                                   ["status", "level", "trigger"])
        self.tokens_freed = Counter("generator_compaction_tokens_freed",
                                    "Tokens a completed compaction took off the context")
        self.summary_time = seconds("generator_summary_seconds",
                                    "Writing one compaction's summary (all its pieces)")
        self.lock_takeovers = Counter("generator_lock_takeovers",
                                      "Session locks taken over from another holder's marker")
        self.head_starts = Counter("generator_head_starts", "Head starts, kept or abandoned",
                                   ["outcome"])
        self.redeliveries = Counter("generator_redeliveries",
                                    "Queries delivered again (a generator died or handed back)")
        self.stale_writes = Counter("generator_stale_writes_rejected",
                                    "History appends refused: another holder wrote first")

    def query_received(self, published: datetime, delivered: int) -> None:
        if delivered == 1:
            self.queue_wait.observe(seconds_since(published))
        else:
            self.redeliveries.inc()

    def turn_finished(self, published: datetime, error_code: str | None) -> None:
        outcome = "failed" if error_code else "answered"
        self.turns.labels(outcome, error_label(error_code)).inc()
        self.turn_time.observe(seconds_since(published))

    def compaction_finished(self, status: str, level: str, auto: bool,
                            before: int | None, after: int | None) -> None:
        self.compactions.labels(status, level, "auto" if auto else "manual").inc()
        if status == "completed" and before is not None and after is not None:
            self.tokens_freed.inc(max(0, before - after))


class DeciderMetrics:
    def __init__(self) -> None:
        self.reports = Counter("decider_generation_reports", "Generation reports read")
        self.estimate_ratio = Histogram(
            "decider_estimate_ratio",
            "The decider's estimate of a prompt's tokens over the provider's count",
            buckets=RATIO_BUCKETS)
        self.estimated_tokens = Counter("decider_estimated_prompt_tokens",
                                        "Prompt tokens as the decider estimated them")
        self.provider_tokens = Counter("decider_provider_prompt_tokens",
                                       "Prompt tokens as the provider counted them")
        self.requests = Counter("decider_compaction_requests",
                                "Automatic compaction requests sent, by level", ["level"])

    def estimate_checked(self, estimate: int, counted: int | None) -> None:
        self.reports.inc()
        if not counted:
            return  # a provider that gave no count: nothing to compare with
        self.estimated_tokens.inc(estimate)
        self.provider_tokens.inc(counted)
        self.estimate_ratio.observe(estimate / counted)


class GatewayMetrics:
    def __init__(self) -> None:
        self.http = Counter("gateway_http_responses", "HTTP responses, by method and status",
                            ["method", "status"])


@cache
def generator() -> GeneratorMetrics:
    return GeneratorMetrics()


@cache
def decider() -> DeciderMetrics:
    return DeciderMetrics()


@cache
def gateway() -> GatewayMetrics:
    return GatewayMetrics()


class Timer:
    """Seconds since it was made, read as often as needed."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@asynccontextmanager
async def timed(histogram: Histogram) -> AsyncIterator[None]:
    """Observe the block's seconds, whether it succeeds or fails."""
    timer = Timer()
    try:
        yield
    finally:
        histogram.observe(timer.elapsed())


_connection_watched: set[int] = set()


def watch_connection(nc: NATS, service: str) -> None:
    """NATS connection state as gauges read at each scrape."""
    if _connection_watched:
        return  # one connection per process (and a metric registers only once)
    _connection_watched.add(id(nc))
    readings: dict[str, tuple[str, Callable[[], float]]] = {
        "nats_connected": ("1 while connected to NATS",
                           lambda: 1.0 if nc.is_connected else 0.0),
        "nats_reconnecting": ("1 while reconnecting to NATS",
                              lambda: 1.0 if nc.is_reconnecting else 0.0),
        "nats_reconnects": ("Reconnections since start",
                            lambda: float(nc.stats.get("reconnects", 0))),
    }
    for name, (documentation, read) in readings.items():
        Gauge(name, documentation, ["service"]).labels(service).set_function(read)


def serve_on(port: int | None, host: str) -> None:
    """Serve /metrics on `port` in a thread of its own; nothing when None."""
    if port is not None:
        start_http_server(port, addr=host)


def exposition() -> bytes:
    return generate_latest(REGISTRY)
