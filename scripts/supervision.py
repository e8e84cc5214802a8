"""The launcher's children (NATS, the stand-in, the services) once started:
each one that exits on its own is started again, as compose's
`restart: unless-stopped` does, and at the end all are stopped in order.

A crash of one process must not take the chat down until someone notices:
the services reconnect to a NATS started again on its store, and a service
started again takes up the queues where its last run left them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# How long a child may take to stop before it is killed; once hurried, one second.
STOP_WAIT_S = 15.0
HURRIED_WAIT_S = 1.0
# A child that ran this long before exiting is started again at once; one that
# exits sooner waits 1, 2, 4 ... up to MAX_PAUSE_S, so a child that cannot
# start does not spin.
STABLE_S = 30.0
MAX_PAUSE_S = 30.0
POLL_S = 0.2

Start = Callable[[], "subprocess.Popen[bytes]"]
# prctl(2): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def tied_to_launcher() -> Callable[[], None] | None:
    """For Popen's `preexec_fn`: the child gets SIGTERM when the launcher dies,
    however it dies (kill -9, the OOM killer), instead of running on with no
    one to stop it, its ports keeping the next `make run` from starting.
    Linux only; elsewhere, None. (The launcher has no threads, whose end
    would count as its death.)"""
    if not sys.platform.startswith("linux"):
        return None
    launcher = os.getpid()

    def tie() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died before the tie was made
            os.kill(os.getpid(), signal.SIGTERM)
    return tie


class StopSignals:
    """Ctrl-C, SIGTERM and SIGHUP. The first one stops everything in order:
    while the services start, a KeyboardInterrupt out of whatever the launcher
    was doing; once they run, `keep_running` sees it and returns. (Raised
    there, it could land inside `Popen.poll()` while it held its lock, never
    to be freed: the stop then waited for that child for good.) Any signal
    once the stop is under way hurries it instead of cutting it short, which
    would leave NATS and the stand-in (in sessions of their own) running."""

    def __init__(self) -> None:
        self.stopping = False
        self.interrupts = True  # False while `keep_running` looks after the children
        self.hurried_at: float | None = None
        for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop_signal, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            if self.interrupts:
                raise KeyboardInterrupt
            return
        if self.hurried_at is None:
            self.hurried_at = time.monotonic()
            say("hurrying: what has not stopped within a second is killed")


@dataclass
class Child:
    """One process of the launcher's, started as soon as it is made and
    started again by `looked_after` whenever it has exited."""

    name: str
    start: Start
    proc: subprocess.Popen[bytes] = field(init=False)
    started_at: float = field(init=False)
    quick_exits: int = 0
    restart_at: float | None = None

    def __post_init__(self) -> None:
        self.launch()

    def launch(self) -> None:
        self.proc = self.start()
        self.started_at = time.monotonic()
        self.restart_at = None

    def looked_after(self, now: float) -> None:
        """Started again if it exited: at once, or after its pause."""
        if self.proc.poll() is None:
            return
        if self.restart_at is None:
            self.restart_at = now + self._pause(now)
            say(f"{self.name} exited with {self.proc.returncode}; starting it again"
                + (f" in {self.restart_at - now:g} s" if self.restart_at > now else ""))
        if now >= self.restart_at:
            self.launch()

    def _pause(self, now: float) -> float:
        self.quick_exits = self.quick_exits + 1 if now - self.started_at < STABLE_S else 0
        return pause_before_restart(self.quick_exits)


def pause_before_restart(quick_exits: int) -> float:
    """No pause after a run that lasted; 1, 2, 4 ... s up to MAX_PAUSE_S after
    that many exits in a row, each soon after its start."""
    return 0.0 if not quick_exits else min(2.0 ** (quick_exits - 1), MAX_PAUSE_S)


def keep_running(children: list[Child], signals: StopSignals) -> None:
    """Look after the children until a stop signal comes."""
    signals.interrupts = False
    while not signals.stopping:
        now = time.monotonic()
        for child in children:
            child.looked_after(now)
        time.sleep(POLL_S)


def stop(children: list[Child], signals: StopSignals) -> None:
    """One at a time, newest first: services drain while NATS is still up."""
    signals.stopping = True
    if any(child.proc.poll() is None for child in children):
        say("stopping: the services finish what they hold, then NATS stops"
            " (Ctrl-C again to hurry)")
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
        wait_or_kill(child.proc, signals)


def wait_or_kill(proc: subprocess.Popen[bytes], signals: StopSignals) -> None:
    asked = time.monotonic()
    while proc.poll() is None:
        deadline = asked + STOP_WAIT_S
        if signals.hurried_at is not None:
            deadline = min(deadline, max(asked, signals.hurried_at) + HURRIED_WAIT_S)
        if time.monotonic() >= deadline:
            proc.kill()
            proc.wait()
            return
        time.sleep(0.05)


def say(line: str) -> None:
    # Once the terminal is closed (its SIGHUP is how a stop begins), writing
    # to it fails; the stop must go on all the same.
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)
