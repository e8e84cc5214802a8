"""The rows: their names in the order shown and the order run, the function that
measures each, the repetitions a run makes, and the Bench that runs one row at
a time on a system started once for the rows that share it."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable

from scripts.benchmarks.against import row_turn_against
from scripts.benchmarks.compaction import row_compaction, row_compaction_one_slot
from scripts.benchmarks.estimate import ESTIMATE_SCRIPT, row_estimate
from scripts.benchmarks.failover import row_failover
from scripts.benchmarks.harness import Env, Params, Row, past_first_seconds, running_env
from scripts.benchmarks.keys import row_turn_keyed
from scripts.benchmarks.memory import row_memory_export, row_memory_sessions
from scripts.benchmarks.messages import row_turn_messages
from scripts.benchmarks.round_trips import (
    Measured,
    RoundTrips,
    row_nats_rtt,
    row_turn_contract_floor,
    row_turn_cpu,
    row_turn_floor,
    row_turn_overhead,
)
from scripts.benchmarks.soak import row_soak_1, row_soak_2
from scripts.benchmarks.splice import row_splice
from scripts.benchmarks.stop import row_stop_latency
from scripts.benchmarks.throughput import (
    row_throughput_1,
    row_throughput_2,
    row_throughput_floor,
)
from scripts.benchmarks.timeline import row_turn_timeline
from scripts.benchmarks.transcript import row_transcript_last_page, row_transcript_overhead
from scripts.benchmarks.weighing import row_turn_weighing

# Rows sharing the plain system run back to back, so it is started once and
# stopped before the compaction row starts systems of its own.
RUN_ORDER = (
    "nats_rtt",
    "turn_floor",
    "throughput_floor",
    "splice_128k",
    "turn_weighing",
    "turn_overhead",
    "turn_cpu",
    "turn_contract_floor",
    "turn_against",
    "turn_messages",
    "turn_timeline",
    "turn_keyed",
    "throughput_1_generator",
    "throughput_2_generators",
    "estimate_error",
    "transcript_overhead",
    "transcript_last_page",
    "compaction_latency",
    "compaction_one_slot",
    "stop_latency",
    "failover_after_kill",
    "memory_sessions",
    "memory_export",
    "soak_1_generator",
    "soak_2_generators",
)


def params_for(quick: bool) -> Params:
    return Params(
        quick=quick,
        rtt_requests=2000,
        overhead_turns=100 if quick else 400,
        overhead_warmup=10 if quick else 20,
        turns_per_session=20,
        stub_calls=100 if quick else 400,
        throughput_sessions=64,
        throughput_settle_s=0.5 if quick else 1.0,
        throughput_window_s=1.0 if quick else 3.0,
        compaction_history_turns=12,
        compaction_queries=10 if quick else 50,
        compaction_rounds=1 if quick else 8,
        compaction_tail_turns=2,
        splice_reps=10 if quick else 50,
        splice_messages=400,
        splice_chars=512_000,
        estimate_turns=4 if quick else len(ESTIMATE_SCRIPT),
    )


RowFunction = Callable[["Bench"], Row]
# Every row and what measures it, in the order the table shows them.
ROW_FUNCTIONS: dict[str, RowFunction] = {
    "nats_rtt": row_nats_rtt,
    "turn_overhead": row_turn_overhead,
    "turn_cpu": row_turn_cpu,
    "turn_floor": row_turn_floor,
    "turn_contract_floor": row_turn_contract_floor,
    "turn_against": row_turn_against,
    "turn_messages": row_turn_messages,
    "turn_timeline": row_turn_timeline,
    "turn_keyed": row_turn_keyed,
    "throughput_1_generator": row_throughput_1,
    "throughput_2_generators": row_throughput_2,
    "throughput_floor": row_throughput_floor,
    "compaction_latency": row_compaction,
    "compaction_one_slot": row_compaction_one_slot,
    "stop_latency": row_stop_latency,
    "failover_after_kill": row_failover,
    "splice_128k": row_splice,
    "turn_weighing": row_turn_weighing,
    "estimate_error": row_estimate,
    "transcript_overhead": row_transcript_overhead,
    "transcript_last_page": row_transcript_last_page,
    "memory_sessions": row_memory_sessions,
    "memory_export": row_memory_export,
    "soak_1_generator": row_soak_1,
    "soak_2_generators": row_soak_2,
}
ROWS = tuple(ROW_FUNCTIONS)
# Rows that start systems of their own: the shared one is stopped before them.
OWN_SYSTEMS = frozenset({"turn_against", "compaction_latency", "compaction_one_slot",
                         "stop_latency", "failover_after_kill",
                         "memory_sessions", "memory_export", "soak_1_generator",
                         "soak_2_generators"})
# Rows that cannot run without starting processes (see --in-process).
NEEDS_PROCESSES = frozenset(ROWS) - {"splice_128k", "turn_weighing", "estimate_error"}


class Bench:
    def __init__(self, params: Params, in_process: bool, against: str | None = None) -> None:
        self.params = params
        self.in_process = in_process
        # Another checkout of the product, for turn_against (--against).
        self.against = against
        self.round_trips: RoundTrips | None = None
        # Measured once, read by several rows: the turns of the product, the floor
        # and the contract floor.
        self.turn_sides: dict[str, Measured] | None = None
        self._plain: Env | None = None
        self._plain_stack = contextlib.ExitStack()

    def plain(self) -> Env:
        """The system with default settings, started on first use and handed
        out once past its generator's first seconds: the rows on it measure a
        running system, not its start."""
        if self._plain is None:
            self._plain = self._plain_stack.enter_context(running_env())
            past_first_seconds(self._plain.started)
        return self._plain

    def close_plain(self) -> None:
        self._plain = None
        self._plain_stack.close()

    def skip_reason(self, name: str) -> str | None:
        """Why this run cannot measure the row, if it cannot."""
        if self.in_process and name in NEEDS_PROCESSES:
            return "needs processes (--in-process)"
        if name == "turn_against" and self.against is None:
            return "needs --against PATH (another checkout of the product)"
        return None

    def run(self, name: str) -> Row:
        # Asked before the shared system is stopped for a row with its own:
        # a row that is skipped must not cost the next rows a fresh start.
        reason = self.skip_reason(name)
        if reason is not None:
            return Row(name=name, value=None, unit="", target=None, detail="skipped",
                       skipped=reason)
        if name in OWN_SYSTEMS:
            self.close_plain()
        started = time.perf_counter()
        load = os.getloadavg()[0]
        # The driver's own garbage collector must not land in a timed query: a full
        # collection here took 260 ms once the earlier rows had left their cycles
        # behind. Collect before the row, none during it (like timeit).
        gc.collect()
        gc.disable()
        try:
            row = ROW_FUNCTIONS[name](self)
        except Exception as err:
            print(f"{name}: {type(err).__name__}: {err}", file=sys.stderr)
            return Row(name=name, value=None, unit="", target=None, detail="error",
                       error=f"{type(err).__name__}: {err}")
        finally:
            gc.enable()
        row.raw["row_seconds"] = time.perf_counter() - started
        # Other work on the machine shows here: a busy machine makes every figure noisier.
        row.raw["load_average_1m_before"] = load
        return row
