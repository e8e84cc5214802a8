"""What every row shares: the run's parameters, a row's result and its target,
and the private system (nats-server, stand-in, services) the rows drive."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.generator.queries import STOP_CLOCK_MARGIN
from tests.nats_server import running_nats
from tests.processes import REPO_ROOT, ServiceProcess
from tests.stub_server import running_stub
from tests.system import System

MODEL = "stub-model"
NUM_CTX = 8192


# --------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Params:
    quick: bool
    rtt_requests: int
    overhead_turns: int
    overhead_warmup: int
    turns_per_session: int
    stub_calls: int
    throughput_sessions: int
    throughput_settle_s: float
    throughput_window_s: float
    compaction_history_turns: int
    compaction_queries: int
    compaction_rounds: int
    compaction_tail_turns: int
    splice_reps: int
    splice_messages: int
    splice_chars: int
    estimate_turns: int


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Target:
    op: str  # "<=" or ">="
    bound: float

    def met(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def text(self) -> str:
        return f"{'≤' if self.op == '<=' else '≥'} {format_number(self.bound)}"


@dataclass
class Row:
    name: str
    value: float | None
    unit: str
    target: Target | None
    detail: str
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None

    @property
    def meets_target(self) -> bool | None:
        if self.target is None or self.value is None:
            return None
        return self.target.met(self.value)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": None if self.target is None
            else {"op": self.target.op, "value": self.target.bound},
            "meets_target": self.meets_target,
            "detail": self.detail,
            "error": self.error,
            "skipped": self.skipped,
            "raw": self.raw,
        }


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01:
        return f"{value:.3g}"
    return f"{value:.2e}"


# --------------------------------------------------------------------------- processes


@dataclass
class Env:
    """One private nats-server, one stand-in, and the services on them."""

    nats_url: str
    stub_url: str
    system: System
    # When its services were up (time.monotonic()).
    started: float

    @property
    def base_url(self) -> str:
        return self.system.base_url


@contextlib.contextmanager
def running_env(stub_flags: Sequence[str] = (), env: dict[str, str] | None = None,
                services: tuple[str, ...] = ("generator", "decider", "gateway"),
                stub_url: str | None = None, root: Path = REPO_ROOT,
                prepare: Callable[[str, ServiceProcess], None] | None = None,
                ) -> Iterator[Env]:
    """The services of the checkout at `root` on a NATS server of their own,
    with the stand-in at `stub_url` (else one of their own, started with
    `stub_flags`). `prepare` is given each service's process before it
    starts (to run it profiled, say)."""
    with running_nats() as server, contextlib.ExitStack() as stack:
        stub = stub_url or stack.enter_context(running_stub(*stub_flags))
        system = System(server.url, stub, env, services, root)
        if prepare is not None:
            for name, process in system.processes.items():
                prepare(name, process)
        try:
            system.start()
            yield Env(server.url, stub, system, time.monotonic())
        except BaseException:
            print(f"service logs (tail):\n{system.logs()}", file=sys.stderr)
            raise
        finally:
            system.stop()
            for process in system.processes.values():
                process.log_path.unlink(missing_ok=True)


def past_first_seconds(started: float) -> None:
    """Returns once a generator that was up at `started` (time.monotonic()) is
    past its first seconds, in which every query also reads the kept error
    replies (a stop sent before it listened may have withdrawn the query):
    rows that count a running system's rate must not count its start."""
    time.sleep(max(0.0, started + STOP_CLOCK_MARGIN.total_seconds() - time.monotonic()))
