"""Benchmark of the whole product: prints a table and writes the figures as JSON.

    python scripts/bench.py                 # every row (a few minutes)
    python scripts/bench.py --quick         # fewer repetitions (under a minute)
    python scripts/bench.py --rows splice_128k,estimate_error --json out.json
    python scripts/bench.py --in-process --rows splice_128k,estimate_error
    python scripts/bench.py --rows turn_against --against ../before   # two checkouts, side by side

Everything runs on this machine and is started here: a private nats-server,
the Ollama stand-in (scripts/ollama_stub/) and the services as real
subprocesses (the classes of tests/system.py), driven over HTTP with aiohttp and
over NATS with nats-py. Figures are ratios measured in the same run (turn
overhead in NATS round trips, throughput as a share of the ideal, latency during
a compaction against latency without one), so they mean the same on a slow
and a fast machine. The rows turn_floor and throughput_floor measure the
same things on scripts/bare_turn.py, the hops a turn needs and nothing else,
as the reference the product's figures can be read against.

Speed is measured, not asserted: a missed target is reported (✗), and the exit
status is non-zero only when a row could not be measured at all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks.harness import Row
from scripts.benchmarks.report import finite, machine_info, table
from scripts.benchmarks.round_trips import serve_echo
from scripts.benchmarks.rows import ROWS, RUN_ORDER, Bench, params_for

JSON_DEFAULT = "bench-results.json"


def parse_rows(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown row(s) {unknown or text!r}; known: {', '.join(ROWS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    parser.add_argument("--json", default=JSON_DEFAULT, metavar="PATH",
                        help=f"where to write the results (default {JSON_DEFAULT})")
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS),
                        metavar="A,B", help="only these rows: " + ", ".join(ROWS))
    parser.add_argument("--against", metavar="PATH",
                        help="another checkout of the product (a git worktree of the "
                             "commit to compare with): row turn_against times its turns "
                             "interleaved with this one's")
    parser.add_argument("--in-process", action="store_true",
                        help="start no process: skip the rows that need NATS or the "
                             "services; estimate_error is emulated in-process")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wanted = set(args.rows)
    params = params_for(args.quick)
    bench = Bench(params, args.in_process, args.against)
    started = time.perf_counter()
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    results: dict[str, Row] = {}
    try:
        for name in RUN_ORDER:
            if name in wanted:
                print(f"running {name} ...", file=sys.stderr, flush=True)
                results[name] = bench.run(name)
    finally:
        bench.close_plain()
    rows = [results[name] for name in ROWS if name in results]
    duration = time.perf_counter() - started
    document = {
        "timestamp": timestamp,
        "duration_s": duration,
        "quick": args.quick,
        "in_process": args.in_process,
        "machine": machine_info(),
        "rows": [row.as_json() for row in rows],
    }
    Path(args.json).write_text(json.dumps(finite(document), indent=2, allow_nan=False) + "\n")
    print(table(rows))
    print(f"\n{len(rows)} row(s) in {duration:.1f} s on {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; JSON written to {args.json}")
    return 1 if any(row.error is not None for row in rows) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--echo-responder"]:
        serve_echo(sys.argv[2])  # the responder of measure_nats_rtt_between_processes
    else:
        raise SystemExit(main())
