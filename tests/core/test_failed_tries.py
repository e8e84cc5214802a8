"""A query's failed attempts: crashes are tried a few times, NATS not
answering is waited out for the patience, neither counts for the other, and
no room is told at once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.core.failed_tries import (
    CRASH_PAUSE_S,
    FIRST_AWAY_PAUSE_S,
    LONGEST_AWAY_PAUSE_S,
    MAX_CRASHES,
    Failure,
    GiveUp,
    Tries,
    TryAgain,
    after_failure,
)

PATIENCE_S = 30.0


def run(failures: list[tuple[bool, float]], patience_s: float = PATIENCE_S
        ) -> list[TryAgain | GiveUp]:
    """The outcome of each failure, (NATS away?, when) in turn, until one gives up."""
    tries, outcomes = Tries(), []
    for away, now in failures:
        failure = Failure.nats_away if away else Failure.crash
        tries, outcome = after_failure(tries, failure, now, patience_s)
        outcomes.append(outcome)
        if isinstance(outcome, GiveUp):
            break
    return outcomes


def test_a_crash_is_tried_again_until_the_last_allowed() -> None:
    outcomes = run([(False, float(t)) for t in range(10)])
    assert outcomes == [TryAgain(CRASH_PAUSE_S)] * (MAX_CRASHES - 1) + [GiveUp("internal_error")]


def test_nats_away_is_waited_out_with_pauses_doubling_to_the_longest() -> None:
    outcomes = run([(True, t * 0.1) for t in range(10)])
    pauses = [o.after_s for o in outcomes if isinstance(o, TryAgain)]
    assert pauses == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert pauses[0] == FIRST_AWAY_PAUSE_S and max(pauses) == LONGEST_AWAY_PAUSE_S


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 100)), min_size=1, max_size=40),
       st.floats(0, 60))
def test_each_kind_gives_up_by_its_own_rule_only(failures: list[tuple[bool, float]],
                                                 patience_s: float) -> None:
    failures.sort(key=lambda failure: failure[1])  # time runs forward
    outcomes = run(failures, patience_s)
    seen = failures[:len(outcomes)]
    crashes = sum(not away for away, _ in seen)
    first_away = next((now for away, now in seen if away), None)
    last_away, last_now = seen[-1]
    if isinstance(outcomes[-1], GiveUp):
        if outcomes[-1].code == "internal_error":
            assert not last_away and crashes == MAX_CRASHES
        else:
            assert last_away and first_away is not None
            assert last_now - first_away >= patience_s
    for (away, now), outcome in zip(seen, outcomes, strict=True):
        if isinstance(outcome, TryAgain) and away:
            assert first_away is not None and now - first_away < patience_s
            assert FIRST_AWAY_PAUSE_S <= outcome.after_s <= LONGEST_AWAY_PAUSE_S
    assert crashes <= MAX_CRASHES


def test_no_patience_gives_up_at_the_first_time_nats_is_away() -> None:
    assert run([(True, 5.0)], patience_s=0) == [GiveUp("nats_unavailable")]


def test_crashes_between_times_nats_was_away_keep_their_own_count() -> None:
    outcomes = run([(True, 0), (False, 1), (True, 2), (False, 3), (True, 4), (False, 5)])
    assert outcomes[-1] == GiveUp("internal_error") and len(outcomes) == 6


def test_no_room_is_told_at_once_and_counts_for_nothing_else() -> None:
    tries = Tries(crashes=1, aways=2, away_since=0.0)
    assert after_failure(tries, Failure.no_room, 1.0, PATIENCE_S) == (
        tries, GiveUp("storage_full"))


def test_a_day_of_patience_keeps_pausing_at_the_longest() -> None:
    """A float power overflowed at the 1,024th try of a long patience."""
    tries = Tries()
    for second in range(5000):
        tries, outcome = after_failure(tries, Failure.nats_away, float(second), 86_400.0)
    assert outcome == TryAgain(LONGEST_AWAY_PAUSE_S) and tries.aways == 5000
