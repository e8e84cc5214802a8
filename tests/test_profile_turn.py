"""scripts/profiled.py and the reading of its profiles by scripts/profile_turn.py.
The whole comparison (two systems, 400 turns each) is a tool to run by hand, not
a test; what it stands on is tested here."""

from __future__ import annotations

import os
import pstats
import subprocess
import sys
from pathlib import Path

from scripts.profile_turn import by_package, package_of, per_turn
from tests.processes import REPO_ROOT

# Switches its own profile on and off, as a driver's signals would.
SELF_SIGNALLING = """
import os, signal

def work():
    return sum(range(100))

def unprofiled():
    return 0

unprofiled()
os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(50):
    work()
os.kill(os.getpid(), signal.SIGUSR1)
unprofiled()
"""


def test_the_profile_holds_what_ran_between_the_two_signals(tmp_path: Path) -> None:
    (tmp_path / "self_signalling.py").write_text(SELF_SIGNALLING)
    out = tmp_path / "out.prof"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}",
           "PROFILED_MODULE": "self_signalling", "PROFILE_OUT": str(out)}
    subprocess.run([sys.executable, "-m", "scripts.profiled"], cwd=REPO_ROOT, env=env,
                   check=True, timeout=60)
    calls = {function: stats[1] for (_, _, function), stats
             in pstats.Stats(str(out)).stats.items()}  # type: ignore[attr-defined]
    assert calls["work"] == 50
    assert "unprofiled" not in calls
    assert per_turn(pstats.Stats(str(out)), 10)[f"{tmp_path}/self_signalling.py:work"][1] == 5


def test_functions_are_counted_to_their_package() -> None:
    assert package_of("services/core/text_size.py:_weigh") == "services"
    assert package_of("nats/aio/client.py:publish") == "nats"
    assert package_of("json/encoder.py:encode") == "json"
    assert package_of("~:<method 'validate_python' of 'pydantic_core._pydantic_core."
                      "SchemaValidator' objects>") == "pydantic"
    assert package_of("~:<built-in method builtins.len>") == "builtins"
    assert package_of("<frozen abc>:__instancecheck__") == "<frozen abc>"
    profile = {"services/a.py:f": (10.0, 1.0), "services/b.py:g": (5.0, 2.0),
               "nats/x.py:h": (1.0, 1.0)}
    assert by_package(profile) == {"services": 15.0, "nats": 1.0}
