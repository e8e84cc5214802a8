"""What a run reports besides its rows: the machine it ran on, the JSON made
safe to write, and the table printed."""

from __future__ import annotations

import math
import os
import platform
import subprocess
from collections.abc import Sequence
from typing import Any

from scripts.benchmarks.harness import Row, format_number
from tests.nats_server import nats_server_binary


def nats_server_version() -> str | None:
    try:
        out = subprocess.run([nats_server_binary(), "--version"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "nats_server": nats_server_version(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def finite(value: Any) -> Any:
    """The same structure with NaN and infinities as null, which JSON has no words for."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def table(rows: Sequence[Row]) -> str:
    header = ("row", "value", "unit", "target", "ok", "detail")
    lines = []
    for row in rows:
        if row.error is not None:
            ok, value = "ERROR", "—"
        elif row.skipped is not None:
            ok, value = "skipped", "—"
        else:
            ok = {True: "✓", False: "✗", None: "—"}[row.meets_target]
            value = "—" if row.value is None else format_number(row.value)
        detail = row.error or row.skipped or row.detail
        lines.append((row.name, value, row.unit, row.target.text() if row.target else "—",
                      ok, detail))
    widths = [max(len(str(line[i])) for line in (header, *lines)) for i in range(5)]

    def fmt(cells: Sequence[str]) -> str:
        first = "  ".join(str(c).ljust(w) for c, w in zip(cells[:5], widths, strict=True))
        return f"{first}  {cells[5]}"

    rule = "-" * (sum(widths) + 2 * 5 + 20)
    return "\n".join([fmt(header), rule, *(fmt(line) for line in lines)])
