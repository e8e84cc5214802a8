"""A turn's own work, function by function: one process of the product (the
generator, by default) profiled with cProfile over sequential turns, against
the same process of the contract floor (scripts/bare_turn.py with the
contract's messages) over the same turns. Prints each side's profiled time a
turn, that time by package, and the functions whose own time a turn differs
most, with their calls a turn.

    python scripts/profile_turn.py                      # the generators
    python scripts/profile_turn.py --process gateway --turns 400 --top 40

A profile slows Python code more than C, so its times run about twice the
real ones: it shows where the difference lies and how many calls make it,
not what a turn costs. An async function counts a call each time it resumes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.benchmarks.client import Http, ask, new_session
from scripts.benchmarks.harness import past_first_seconds
from scripts.benchmarks.measure import cpu_seconds
from scripts.benchmarks.round_trips import bare_ask, running_bare_turn
from tests.nats_server import running_nats
from tests.processes import ServiceProcess
from tests.stub_server import running_stub
from tests.system import System

TURNS_PER_SESSION = 20  # as turn_overhead asks them
WRITE_WAIT_S = 30.0
# The floor's processes are roles of one module; the product's, services.
FLOOR_ROLE = {"generator": "generator", "gateway": "gateway", "decider": "decider"}
Drive = Callable[[int], None]
Asker = Callable[[Http, str, str], Awaitable[object]]
# (own µs, calls) a turn, by function.
Profile = dict[str, tuple[float, float]]


def profiled(process: ServiceProcess, out: Path) -> None:
    """`process` to start under scripts/profiled.py, its profile written to `out`."""
    process.env = {**process.env, "PROFILED_MODULE": process.module, "PROFILE_OUT": str(out)}
    process.module = "scripts.profiled"


def driver(base_url: str, new: Callable[[Http], Awaitable[str]], asker: Asker) -> Drive:
    """Asks a number of questions one after another, in sessions of TURNS_PER_SESSION."""
    async def turns(count: int) -> None:
        async with Http(base_url, 4) as http:
            sid = ""
            for index in range(count):
                if index % TURNS_PER_SESSION == 0:
                    sid = await new(http)
                await asker(http, sid, f"question {index}")

    return lambda count: asyncio.run(turns(count))


def profile_turns(process: ServiceProcess, out: Path, drive: Drive, turns: int
                  ) -> tuple[Profile, float]:
    """A session to warm up, `turns` turns unprofiled (the process's CPU a turn,
    in µs, is returned beside the profile), then as many profiled."""
    drive(TURNS_PER_SESSION)
    pid = process.proc.pid if process.proc else 0
    before = process_cpu_s(pid)
    drive(turns)
    cpu_us = (process_cpu_s(pid) - before) * 1e6 / turns
    process.signal(signal.SIGUSR1)
    drive(turns)
    process.signal(signal.SIGUSR1)
    deadline = time.monotonic() + WRITE_WAIT_S
    while True:
        try:
            return per_turn(pstats.Stats(str(out)), turns), cpu_us
        except (OSError, EOFError, TypeError, ValueError):
            if time.monotonic() > deadline:  # not written, or not whole yet
                raise
            time.sleep(0.1)


def product_profile(stub: str, name: str, out: Path, turns: int) -> tuple[Profile, float]:
    with running_nats() as server:
        system = System(server.url, stub)
        profiled(system.processes[name], out)
        system.start()
        try:
            past_first_seconds(time.monotonic())  # kept errors read at first: not a turn's
            drive = driver(system.base_url, new_session,
                           lambda http, sid, content: ask(http, sid, content))
            return profile_turns(system.processes[name], out, drive, turns)
        finally:
            system.stop()


def floor_profile(stub: str, name: str, out: Path, turns: int) -> tuple[Profile, float]:
    chosen: list[ServiceProcess] = []

    def prepare(role: str, process: ServiceProcess) -> None:
        if role == FLOOR_ROLE[name]:
            profiled(process, out)
            chosen.append(process)

    with running_bare_turn(stub, contract=True, prepare=prepare) as (_, _, base_url):
        async def new(_: Http) -> str:
            return os.urandom(16).hex()

        drive = driver(base_url, new, lambda http, sid, content: bare_ask(http)(sid, content))
        return profile_turns(chosen[0], out, drive, turns)


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
    for marker in ("site-packages/", python, str(Path.cwd()) + "/"):
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
    parser.add_argument("--process", choices=sorted(FLOOR_ROLE), default="generator")
    parser.add_argument("--turns", type=int, default=400)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with running_stub() as stub, tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        ours = product_profile(stub, args.process, Path(tmp) / "product.prof", args.turns)
        theirs = floor_profile(stub, args.process, Path(tmp) / "floor.prof", args.turns)
    print_comparison(ours, theirs, args.process, args.top)


if __name__ == "__main__":
    main()
