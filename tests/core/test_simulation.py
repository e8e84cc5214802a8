"""The seeded deterministic simulation: 1,000 scenarios by default.

SIM_SCENARIOS raises the count; SIM_SEED=<seed> with `-k replay` runs one seed.
"""

from __future__ import annotations

import math
import os
import time

import pytest

from tests.core.simulation import REPLAY_HINT, InvariantViolation, Stats, run_scenario

SCENARIOS = int(os.environ.get("SIM_SCENARIOS", "1000"))
REPLAY_SEED = os.environ.get("SIM_SEED")


# A thousand long sessions take about half a minute alone, and several times
# that on a machine busy with other work: the default limit is for single tests.
@pytest.mark.timeout(900)
def test_simulation() -> None:
    started = time.monotonic()
    failures: list[str] = []
    total = Stats()
    for seed in range(SCENARIOS):
        try:
            stats = run_scenario(seed)
        except InvariantViolation as err:
            failures.append(str(err))
            if len(failures) >= 5:
                break
            continue
        _accumulate(total, stats)
    assert not failures, f"{len(failures)}+ scenario(s) broke an invariant:\n" + "\n".join(
        failures
    )
    print(
        f"\n{SCENARIOS} scenarios in {time.monotonic() - started:.1f}s: {total.calls} calls, "
        f"{total.decider_firings} decider firings, {total.emergency_compactions} emergency "
        f"compactions, {total.splices} splices, {total.conflicts} splice conflicts, "
        f"{total.refused_turns} refused turns ({total.hopeless_refusals} at once: no compaction "
        f"could help), {total.tool_results_cut} turns with tool output cut, "
        f"{total.rejected_queries} queries rejected while blocking; {total.summary_calls} "
        f"summary calls ({total.summaries_in_pieces} summaries in pieces, {total.entries_cut} "
        f"entries cut, {total.summaries_cut_off} cut off and written again), fullest "
        f"{total.max_summary_fill:.1%} of the summariser's budget; fullest prompt "
        f"{total.max_fill:.1%} of budget, worst "
        f"underestimate {total.max_underestimate:.1%}, overestimate "
        f"{total.max_overestimate:.1%}; mixed sessions: {total.mixed_calls} calibrated calls, "
        f"{total.mixed_within_5pct / max(1, total.mixed_calls):.1%} within 5 %, worst "
        f"{total.mixed_underestimate:.1%} under and {total.mixed_overestimate:.1%} over, "
        f"{total.learnt_within_5pct / max(1, total.learnt_calls):.1%} of the "
        f"{total.learnt_calls} made once dense text had its own rate; "
        "closest firings: decider "
        f"{total.decider_excess:+.1%} from its threshold, guard {total.guard_excess:+.1%} "
        "from the emergency line (fractions of the budget); least relief of a decider's "
        f"compaction {total.least_relief:.2f} x the minimum"
    )
    # The world must actually exercise the paths the invariants guard.
    assert total.decider_firings and total.emergency_compactions and total.conflicts
    assert total.splices and total.refused_turns and total.rejected_queries
    assert total.summaries_in_pieces and total.entries_cut and total.summaries_cut_off
    assert total.hopeless_refusals and total.tool_results_cut
    assert total.mixed_calls
    # Mixed scripts: never underestimated beyond the margin, and within 5 %
    # once dense text has been counted (before that it is charged cautiously).
    assert total.mixed_underestimate <= 0.05
    assert total.learnt_within_5pct >= 0.99 * total.learnt_calls > 0


def _accumulate(total: Stats, stats: Stats) -> None:
    for name in ("calls", "refused_turns", "decider_firings", "emergency_compactions",
                 "splices", "conflicts", "rejected_queries", "summary_calls", "summaries_cut_off",
                 "summaries_in_pieces", "entries_cut", "hopeless_refusals", "tool_results_cut"):
        setattr(total, name, getattr(total, name) + getattr(stats, name))
    total.max_fill = max(total.max_fill, stats.max_fill)
    total.max_summary_fill = max(total.max_summary_fill, stats.max_summary_fill)
    total.max_underestimate = max(total.max_underestimate, stats.max_underestimate)
    total.max_overestimate = max(total.max_overestimate, stats.max_overestimate)
    total.mixed_underestimate = max(total.mixed_underestimate, stats.mixed_underestimate)
    total.mixed_overestimate = max(total.mixed_overestimate, stats.mixed_overestimate)
    total.mixed_calls += stats.mixed_calls
    total.mixed_within_5pct += stats.mixed_within_5pct
    total.learnt_calls += stats.learnt_calls
    total.learnt_within_5pct += stats.learnt_within_5pct
    total.decider_excess = min(total.decider_excess, stats.decider_excess)
    total.guard_excess = min(total.guard_excess, stats.guard_excess)
    total.least_relief = min(total.least_relief, stats.least_relief)


@pytest.mark.skipif(REPLAY_SEED is None, reason="set SIM_SEED=<seed> to replay one scenario")
def test_replay() -> None:
    assert REPLAY_SEED is not None
    print(f"\nreplaying: {REPLAY_HINT.format(seed=REPLAY_SEED)}")
    stats = run_scenario(int(REPLAY_SEED))
    print(stats)


def test_same_seed_same_world() -> None:
    assert run_scenario(7) == run_scenario(7)
    assert math.isfinite(run_scenario(7).max_fill)


def test_a_violation_names_its_seed_and_how_to_rerun_it() -> None:
    err = InvariantViolation(42, "turn 3", "something broke")
    assert "seed 42" in str(err)
    assert "SIM_SEED=42 pytest tests/core/test_simulation.py -k replay" in str(err)
