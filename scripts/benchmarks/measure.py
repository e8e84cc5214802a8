"""Figures from samples: percentiles and summaries of latencies, and the CPU
time this process and the processes it started spent per unit of work."""

from __future__ import annotations

import math
import os
import resource
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def cpu_seconds() -> dict[str, float]:
    """CPU time (user + system) so far of this process and of each process it started,
    keyed "what:pid" (Linux /proc; empty elsewhere)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {f"bench:{os.getpid()}": usage.ru_utime + usage.ru_stime}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # The command name in parentheses may hold spaces: fields start after it.
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[1]) != os.getpid():
            continue
        out[f"{process_label(argv)}:{stat.parent.name}"] = (
            int(fields[11]) + int(fields[12])) / tick
    return out


def process_label(argv: Sequence[bytes]) -> str:
    words = [a.decode(errors="replace") for a in argv if a]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1].rsplit(".", 1)[-1]
    return Path(words[0]).name if words else "?"


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process spent between two `cpu_seconds()` readings."""
    return {key: after[key] - before.get(key, 0.0) for key in after}


def cpu_per_unit(before: dict[str, float], after: dict[str, float], units: int,
                 wall_s: float) -> dict[str, Any]:
    """CPU milliseconds per unit of work by process, and how busy the cores were."""
    return cpu_summary(cpu_used(before, after), units, wall_s)


def started_processes() -> frozenset[str]:
    """The `cpu_seconds` keys of the processes running now besides the driver."""
    return frozenset(key for key in cpu_seconds() if not key.startswith("bench:"))


def cpu_summary(used: dict[str, float], units: int, wall_s: float) -> dict[str, Any]:
    """`cpu_per_unit` of CPU seconds already added up by process."""
    labels = [key.split(":")[0] for key in used]
    per_unit = {}
    for key, seconds in sorted(used.items()):
        label = key.split(":")[0]
        name = label if labels.count(label) == 1 else key
        per_unit[name] = seconds * 1000 / units
    total = sum(used.values())
    return {
        "cpu_ms_per_unit_by_process": per_unit,
        "cpu_ms_per_unit": total * 1000 / units,
        "cores_busy": total / wall_s,
        "cores": os.cpu_count(),
    }
