"""The launcher's restarts: how long a child that keeps exiting waits, and
that one which exits is started again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from scripts.supervision import (
    MAX_PAUSE_S,
    STABLE_S,
    Child,
    StopSignals,
    keep_running,
    pause_before_restart,
)


def test_the_pause_doubles_with_each_quick_exit_up_to_its_cap() -> None:
    pauses = [pause_before_restart(exits) for exits in range(12)]
    assert pauses[:7] == [0, 1, 2, 4, 8, 16, MAX_PAUSE_S]
    assert all(pause == MAX_PAUSE_S for pause in pauses[6:])


def exits_at_once() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", ""])


def test_a_child_that_exits_is_started_again_after_its_pause() -> None:
    child = Child("quick", exits_at_once)
    first = child.proc
    first.wait()
    soon = child.started_at + 1
    child.looked_after(soon)  # a quick exit: one second's pause
    assert child.proc is first and child.restart_at == soon + 1
    child.looked_after(soon + 1)
    assert child.proc is not first and child.quick_exits == 1
    child.proc.wait()
    child.looked_after(child.started_at + STABLE_S)  # it had lasted: at once
    assert child.quick_exits == 0 and child.restart_at is None
    child.proc.wait()



class SignalledOnItsFirstLook:
    """A child (as `keep_running` sees one) whose first look-after a stop
    signal interrupts, as one may interrupt `Popen.poll()` inside it."""

    def __init__(self) -> None:
        self.looks = 0

    def looked_after(self, now: float) -> None:
        self.looks += 1
        if self.looks == 1:
            os.kill(os.getpid(), signal.SIGHUP)


def test_a_stop_signal_while_the_children_run_ends_the_watch_without_an_interrupt() -> None:
    """Raised as a KeyboardInterrupt, it could land inside `Popen.poll()` while
    that held its lock, which was never freed: the stop then waited for that
    child for good (`make run` with its terminal closed, now and then)."""
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    child = SignalledOnItsFirstLook()
    try:
        signals = StopSignals()
        keep_running([child], signals)  # type: ignore[list-item]
    except KeyboardInterrupt:
        pytest.fail("the stop signal interrupted the look after the children")
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    assert signals.stopping and child.looks == 1
