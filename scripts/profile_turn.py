"""A turn's own work, function by function: one process of the product (the
generator, by default) profiled with cProfile over sequential turns, against
the same process of the contract floor (scripts/bare_turn.py with the
contract's messages) over the same turns. Prints each side's profiled time a
turn, that time by package, and the functions whose own time a turn differs
most, with their calls a turn.

    python scripts/profile_turn.py                      # the generators
    python scripts/profile_turn.py --process gateway --sessions 20 --top 40

A profile slows Python code more than C, so its times run about twice the
real ones: it shows where the difference lies and how many calls make it,
not what a turn costs. An async function counts a call each time it resumes.
"""

from __future__ import annotations

import argparse
import asyncio
import pstats
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks.client import Http
from scripts.benchmarks.harness import past_first_seconds, running_env
from scripts.benchmarks.measure import cpu_seconds
from scripts.benchmarks.round_trips import (
    Side,
    bare_ask,
    bare_session,
    product_side,
    running_bare_turn,
)
from tests.processes import REPO_ROOT, ServiceProcess
from tests.stub_server import running_stub

TURNS_PER_SESSION = 20  # as turn_overhead asks them
WRITE_WAIT_S = 30.0
# The processes one can profile: the product's services and the floor's roles
# go by the same names.
PROCESSES = ("generator", "gateway", "decider")
# A side's turns through the HTTP client it is given.
SideOf = Callable[[Http], Side]
# (own µs, calls) a turn, by function.
Profile = dict[str, tuple[float, float]]


def profiled_as(name: str, out: Path) -> Callable[[str, ServiceProcess], None]:
    """A `prepare` hook: the process called `name` is started under
    scripts/profiled.py, its profile written to `out`."""
    def prepare(process_name: str, process: ServiceProcess) -> None:
        if process_name == name:
            process.env = {**process.env, "PROFILED_MODULE": process.module,
                           "PROFILE_OUT": str(out)}
            process.module = "scripts.profiled"
    return prepare


def ask_sessions(base_url: str, side_of: SideOf, sessions: int) -> None:
    """`sessions` sessions of TURNS_PER_SESSION questions, one after another."""
    async def ask() -> None:
        async with Http(base_url, 4) as http:
            side = side_of(http)
            for _ in range(sessions):
                await side.session(TURNS_PER_SESSION, timed=False)

    asyncio.run(ask())


def profile_turns(process: ServiceProcess, out: Path, base_url: str, side_of: SideOf,
                  sessions: int) -> tuple[Profile, float]:
    """A session to warm up, `sessions` unprofiled (the process's CPU a turn,
    in µs, is returned beside the profile), then as many profiled."""
    turns = sessions * TURNS_PER_SESSION
    ask_sessions(base_url, side_of, 1)
    pid = process.proc.pid if process.proc else 0
    before = process_cpu_s(pid)
    ask_sessions(base_url, side_of, sessions)
    cpu_us = (process_cpu_s(pid) - before) * 1e6 / turns
    process.signal(signal.SIGUSR1)
    ask_sessions(base_url, side_of, sessions)
    process.signal(signal.SIGUSR1)
    deadline = time.monotonic() + WRITE_WAIT_S
    while not out.exists():  # moved in place whole (scripts/profiled.py)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no profile written to {out}")
        time.sleep(0.1)
    return per_turn(pstats.Stats(str(out)), turns), cpu_us


def product_profile(stub: str, name: str, out: Path, sessions: int) -> tuple[Profile, float]:
    with running_env(stub_url=stub, prepare=profiled_as(name, out)) as env:
        past_first_seconds(env.started)  # kept errors read at first: not a turn's
        return profile_turns(env.system.processes[name], out, env.base_url,
                             lambda http: product_side("product", http, frozenset()), sessions)


def floor_profile(stub: str, name: str, out: Path, sessions: int) -> tuple[Profile, float]:
    processes: dict[str, ServiceProcess] = {}

    def prepare(role: str, process: ServiceProcess) -> None:
        processes[role] = process
        profiled_as(name, out)(role, process)

    with running_bare_turn(stub, contract=True, prepare=prepare) as (_, _, base_url):
        return profile_turns(processes[name], out, base_url,
                             lambda http: Side("floor", bare_session, bare_ask(http),
                                               frozenset()), sessions)


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far of `pid`, a process this one started."""
    return next(used for key, used in cpu_seconds().items() if key.endswith(f":{pid}"))


def per_turn(stats: pstats.Stats, turns: int) -> Profile:
    found: Profile = {}
    for (path, _, function), (_, calls, own_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{short_path(path)}:{function}"
        own_us, count = found.get(key, (0.0, 0.0))
        found[key] = (own_us + own_s * 1e6 / turns, count + calls / turns)
    return found


def short_path(path: str) -> str:
    python = f"python{sys.version_info.major}.{sys.version_info.minor}/"
    for marker in ("site-packages/", python, f"{REPO_ROOT}/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def package_of(key: str) -> str:
    """Who a function belongs to: our code, a library, the standard library."""
    path, _, function = key.partition(":")
    if path == "~":  # a built-in: named after the library whose C code it is
        found = re.search(r"of '(\w+)", function)
        return found.group(1).split("_")[0] if found else "builtins"
    if path.startswith("<"):
        return path
    top = path.split("/", 1)[0]
    return top.removesuffix(".py")


def by_package(profile: Profile) -> dict[str, float]:
    totals: dict[str, float] = {}
    for key, (own_us, _) in profile.items():
        package = package_of(key)
        totals[package] = totals.get(package, 0.0) + own_us
    return totals


def print_packages(ours: Profile, theirs: Profile, count: int = 12) -> None:
    mine, other = by_package(ours), by_package(theirs)
    print(f"{'package':24} {'product':>9} {'floor':>9}")
    for package in sorted(set(mine) | set(other),
                          key=lambda p: -(mine.get(p, 0.0) + other.get(p, 0.0)))[:count]:
        print(f"{package:24} {mine.get(package, 0.0):9.0f} {other.get(package, 0.0):9.0f}")


def print_functions(ours: Profile, theirs: Profile, top: int) -> None:
    """The functions whose own time a turn is most above the floor's."""
    def excess(key: str) -> float:
        return ours.get(key, (0.0, 0.0))[0] - theirs.get(key, (0.0, 0.0))[0]

    print(f"\n{'µs a turn':>9} {'floor':>7} {'calls':>6} {'floor':>6}  function")
    for key in sorted(set(ours) | set(theirs), key=excess, reverse=True)[:top]:
        (us, calls), (us_floor, calls_floor) = (ours.get(key, (0.0, 0.0)),
                                                theirs.get(key, (0.0, 0.0)))
        print(f"{us:9.1f} {us_floor:7.1f} {calls:6.1f} {calls_floor:6.1f}  {key[:90]}")


def print_comparison(product: tuple[Profile, float], floor: tuple[Profile, float], name: str,
                     top: int) -> None:
    (ours, cpu_ours), (theirs, cpu_theirs) = product, floor
    total_ours, total_theirs = (sum(us for us, _ in p.values()) for p in (ours, theirs))
    print(f"{name}, µs a turn: product {cpu_ours:.0f} of CPU ({total_ours:.0f} profiled), "
          f"contract floor {cpu_theirs:.0f} ({total_theirs:.0f} profiled)\n")
    print_packages(ours, theirs)
    print_functions(ours, theirs, top)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--process", choices=PROCESSES, default="generator")
    parser.add_argument("--sessions", type=int, default=20,
                        help=f"sessions of {TURNS_PER_SESSION} turns a side (default 20)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with running_stub() as stub, tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        ours = product_profile(stub, args.process, Path(tmp) / "product.prof", args.sessions)
        theirs = floor_profile(stub, args.process, Path(tmp) / "floor.prof", args.sessions)
    print_comparison(ours, theirs, args.process, args.top)


if __name__ == "__main__":
    main()
