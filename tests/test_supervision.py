"""The launcher's restarts: how long a child that keeps exiting waits, and
that one which exits is started again."""

from __future__ import annotations

import subprocess
import sys

from scripts.supervision import MAX_PAUSE_S, STABLE_S, Child, pause_before_restart


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
