"""Run a service's module under cProfile, switched by SIGUSR1: the first
signal starts the profile, the next stops it and writes it to PROFILE_OUT.
So a profile holds the turns a driver asked for, not the start-up
(`scripts/profile_turn.py`).

    PROFILED_MODULE=services.generator PROFILE_OUT=gen.prof python -m scripts.profiled
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal


def main() -> None:
    profile = cProfile.Profile()
    running = False

    def switch(*_: object) -> None:
        nonlocal running
        if running:
            profile.disable()
            # Written aside, then moved in place: a reader waiting for the
            # file never finds it half written.
            out = os.environ["PROFILE_OUT"]
            profile.dump_stats(f"{out}.part")
            os.replace(f"{out}.part", out)
        else:
            profile.enable()
        running = not running

    signal.signal(signal.SIGUSR1, switch)
    runpy.run_module(os.environ["PROFILED_MODULE"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
