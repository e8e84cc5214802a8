from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, Conversation
from schemas.messages import Level
from services.core.boundary import choose_boundary, tail_turns_for
from services.core.context import (
    context_tokens,
    next_prompt_size,
    part_tokens,
    summary_allowance,
)
from services.core.decision import (
    FIT_MARGIN,
    STALE_REPORT_GRACE_S,
    Decision,
    Fit,
    Observation,
    Policy,
    SessionMemory,
    answer_room,
    awaits_result,
    check_fit,
    decide,
    level_for,
    on_compacted,
    on_report,
    on_result,
)
from services.core.splice import plan_compaction, splice
from services.core.text_size import HistoryWeights
from services.core.tokens import (
    Calibration,
    budget,
    calibrate,
    default_headroom,
    estimate_tokens,
    prompt_budget,
)

BUDGET = 10000
FRESH = SessionMemory()


def expected_level(tokens: int, budget_: int, threshold: float) -> Level | None:
    """Written from the brief: percentages of the budget, no shared code."""
    pct = 100 * tokens / budget_
    if threshold <= 0 or pct < 100 * threshold - 1e-9:
        return None
    if pct >= 95 - 1e-9:
        return Level.emergency
    if pct >= 100 * (threshold + (1 - threshold) / 2) - 1e-9:
        return Level.tighter
    return Level.gentle


THRESHOLDS = [0.0, 0.5, 0.6, 0.8, 0.9, 0.97, 1.0]
TOKENS = sorted({0, 1, 4999, 5000, 5999, 6000, 7999, 8000, 8999, 9000, 9499, 9500, 9699,
                 9700, 9999, 10000, 12000})


@pytest.mark.parametrize(("tokens", "threshold"), list(itertools.product(TOKENS, THRESHOLDS)))
def test_level_for_every_point(tokens: int, threshold: float) -> None:
    assert level_for(tokens, BUDGET, Policy(threshold=threshold)) == expected_level(
        tokens, BUDGET, threshold
    )


MEMORIES = [
    SessionMemory(),
    SessionMemory(pending=True, last_fired_at=90.0),
    SessionMemory(pending=True, last_fired_at=-200.0),  # unanswered for exactly the expiry
    SessionMemory(pending=True, last_fired_at=-900.0),  # unanswered for long: taken as lost
    SessionMemory(pending=False, last_fired_at=90.0),  # 10 s ago
    SessionMemory(pending=False, last_fired_at=70.0),  # exactly the cooldown ago
    SessionMemory(pending=False, last_fired_at=10.0),  # long ago
]
RELIEF = [0, 999, 1000, 5000]
# (existing summary, bound of the summary a compaction writes), in tokens.
SUMMARIES = [(0, 0), (0, 300), (800, 300), (300, 800), (4000, 300)]


@pytest.mark.parametrize(
    ("tokens", "threshold", "memory", "raw", "summaries"),
    list(itertools.product(TOKENS, THRESHOLDS, MEMORIES, RELIEF, SUMMARIES)),
)
def test_decide_every_combination(
    tokens: int, threshold: float, memory: SessionMemory, raw: int,
    summaries: tuple[int, int],
) -> None:
    summary, allowance = summaries
    policy = Policy(threshold=threshold, cooldown_s=30.0, min_relief=0.1, pending_expiry_s=300.0)
    now = 100.0
    obs = Observation(tokens, BUDGET, raw + summary, now, summary, allowance)
    decision, after = decide(obs, memory, policy)

    level = expected_level(tokens, BUDGET, threshold)
    cooling = memory.last_fired_at is not None and now - memory.last_fired_at < 30.0
    awaiting = memory.pending and (memory.last_fired_at is None
                                   or now - memory.last_fired_at < 300.0)
    # The summary is rewritten, not freed, and the new one may be as large as its bound.
    freed = raw + summary - max(summary, allowance)
    should_fire = (
        level is not None
        and not awaiting
        and (level is Level.emergency or not cooling)
        and freed >= 1000
    )
    assert freed > 0 or not decision.fire
    assert decision.fire is should_fire
    if should_fire:
        assert decision.level is level
        assert after == SessionMemory(True, now)
    else:
        assert decision.level is None
        assert after == memory
    assert decision.reason


def test_reason_names_the_numbers() -> None:
    decision, _ = decide(Observation(9210, BUDGET, 5000, 0.0), FRESH, Policy())
    assert decision == Decision(
        True, Level.tighter,
        "estimate 9210 of budget 10000 tokens (92%) >= threshold 80%: compact (tighter)",
    )


@pytest.mark.parametrize(
    ("obs", "memory", "policy", "words"),
    [
        (Observation(9000, BUDGET, 5000, 0.0), FRESH, Policy(threshold=0), ["disabled"]),
        (Observation(7000, BUDGET, 5000, 0.0), FRESH, Policy(), ["7000", "70%", "below"]),
        (Observation(9000, BUDGET, 5000, 0.0), SessionMemory(pending=True), Policy(), ["pending"]),
        (Observation(9000, BUDGET, 5000, 10.0), SessionMemory(last_fired_at=0.0), Policy(),
         ["cooling down", "10.0s", "30s"]),
        (Observation(9000, BUDGET, 400, 0.0), FRESH, Policy(), ["400", "1000", "not worth"]),
        (Observation(9000, BUDGET, 1500, 0.0, 800, 600), FRESH, Policy(),
         ["about 700", "1500", "800", "1000", "not worth"]),
    ],
)
def test_reasons_for_not_firing(
    obs: Observation, memory: SessionMemory, policy: Policy, words: list[str]
) -> None:
    decision, after = decide(obs, memory, policy)
    assert not decision.fire and after == memory
    for word in words:
        assert word in decision.reason


def test_a_compaction_that_frees_nothing_is_vetoed_even_without_a_minimum() -> None:
    policy = Policy(min_relief=0.0)
    # Only the summary lies before the live zone: it would be rewritten, nothing freed.
    nothing, _ = decide(Observation(9000, BUDGET, 800, 0.0, 800, 300), FRESH, policy)
    assert not nothing.fire and "about 0 tokens" in nothing.reason
    some, _ = decide(Observation(9000, BUDGET, 801, 0.0, 800, 300), FRESH, policy)
    assert some.fire


def test_emergency_ignores_cooldown_but_never_pending() -> None:
    recent = SessionMemory(last_fired_at=99.0)
    fired, _ = decide(Observation(9600, BUDGET, 5000, 100.0), recent, Policy())
    assert fired.fire and fired.level is Level.emergency
    blocked, _ = decide(Observation(9600, BUDGET, 5000, 100.0), replace(recent, pending=True),
                        Policy())
    assert not blocked.fire


def test_a_request_unanswered_past_the_expiry_is_asked_again() -> None:
    """A lost publish or a missed result must not turn automatic compaction off
    for good: once the expiry has passed, the session is asked for again, and
    the new request is pending in its turn."""
    policy = Policy(cooldown_s=0.0, pending_expiry_s=60.0)
    memory = SessionMemory(pending=True, last_fired_at=100.0)
    assert awaits_result(memory, 159.9, policy)
    assert not awaits_result(memory, 160.0, policy)
    blocked, same = decide(Observation(9000, BUDGET, 5000, 159.9), memory, policy)
    assert not blocked.fire and same == memory and "pending" in blocked.reason
    again, after = decide(Observation(9000, BUDGET, 5000, 160.0), memory, policy)
    assert again.fire and after == SessionMemory(True, 160.0)
    assert "no result in time" in again.reason
    assert awaits_result(after, 160.0, policy)
    assert not awaits_result(SessionMemory(), 0.0, policy)
    assert awaits_result(SessionMemory(pending=True), 1e9, policy)  # no time known: waits


def test_on_result_clears_pending() -> None:
    pending = SessionMemory(pending=True, last_fired_at=5.0)
    assert on_result(pending, 1234, 40.0) == SessionMemory(False, 5.0)
    # A failed compaction restarts the cooldown, so a broken summariser is not hammered.
    assert on_result(pending, None, 40.0) == SessionMemory(False, 40.0)


def test_a_report_measured_before_the_latest_compaction_is_not_acted_on() -> None:
    """Its result was read first: the report's sizes are those of a history
    the splice has replaced, and acting on them would compact a second time."""
    policy = Policy(cooldown_s=0.0)
    asked, memory = decide(Observation(9000, BUDGET, 5000, 10.0, compactions=1), FRESH, policy)
    assert asked.fire
    memory = on_result(on_compacted(memory, 2), 2000, 50.0)
    stale, same = decide(Observation(9600, BUDGET, 5000, 51.0, compactions=1), memory, policy)
    assert not stale.fire and same == memory and "out of date" in stale.reason
    fresh, _ = decide(Observation(9600, BUDGET, 5000, 52.0, compactions=2), memory, policy)
    assert fresh.fire  # measured after it: judged as any other
    unknown, _ = decide(Observation(9600, BUDGET, 5000, 52.0), memory, policy)
    assert unknown.fire  # a generator that does not say is taken at its word


def test_only_a_newer_compaction_count_is_kept() -> None:
    memory = on_compacted(SessionMemory(), 3)
    assert on_compacted(memory, 2) == memory and on_compacted(memory, None) == memory
    assert on_compacted(memory, 4).compactions == 4


def test_a_count_the_reports_long_after_its_result_contradict_gives_way() -> None:
    """A history deleted and begun again under its id, or a result claiming a
    million compactions, would otherwise have every later report passed over
    as out of date: no automatic compaction for the session again."""
    policy = Policy(cooldown_s=0.0)
    claimed = on_compacted(SessionMemory(), 1_000_000, stored_at=100.0)
    late = 100.0 + STALE_REPORT_GRACE_S
    assert on_report(claimed, 0, late - 0.001) == claimed  # may have been measured before it
    assert on_report(claimed, 0, None) == claimed
    assert on_report(replace(claimed, compacted_at=None), 0, late) == replace(
        claimed, compacted_at=None)  # when it was stored unknown: the result is believed
    assert on_report(claimed, 1_000_000, late) == claimed
    assert on_report(claimed, None, late) == claimed  # a generator that does not say
    # One such report may be one measured before, held up on its way: two in a row are proof.
    once = on_report(claimed, 2, late)
    assert once.compactions == 1_000_000 and once.contradictions == 1
    assert on_report(once, 1_000_000, late + 1) == claimed  # the count holds after all
    believed = on_report(once, 2, late + 1)
    assert believed == SessionMemory(compactions=2, compacted_at=late + 1)
    decision, _ = decide(Observation(9600, BUDGET, 5000, 1.0, compactions=2), believed, policy)
    assert decision.fire
    # Begun again once more (deleted again under its id): the same way out.
    again = on_report(on_report(believed, 0, late + 10), 0, late + 11)
    assert again == SessionMemory(compactions=0, compacted_at=late + 11)
    # A later real compaction is the line again, with its own time.
    assert on_compacted(believed, 3, stored_at=500.0) == SessionMemory(compactions=3,
                                                                      compacted_at=500.0)


def test_one_crossing_fires_once() -> None:
    """Hysteresis: the estimate stays above threshold for many turns; one firing until a result."""
    policy, memory, fired = Policy(), FRESH, []
    for step in range(20):
        decision, memory = decide(Observation(8500 + step, BUDGET, 5000, step * 5.0), memory,
                                  policy)
        fired.append(decision.fire)
    assert fired.count(True) == 1 and fired[0]


@pytest.mark.parametrize(
    ("kwargs"), [{"threshold": -0.1}, {"threshold": 1.5}, {"cooldown_s": -1}, {"min_relief": 2},
                 {"pending_expiry_s": 0}]
)
def test_policy_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Policy(**kwargs)


def test_check_fit_exact() -> None:
    assert check_fit(999, 1000, margin=0) == Fit(True, 0)
    assert check_fit(1000, 1000, margin=0) == Fit(True, 0)
    assert check_fit(1001, 1000, margin=0) == Fit(False, 1)
    assert check_fit(5000, 1000, margin=0) == Fit(False, 4000)


def test_check_fit_keeps_the_default_margin_in_reserve() -> None:
    assert pytest.approx(0.05) == FIT_MARGIN
    assert check_fit(950, 1000) == Fit(True, 0)
    assert check_fit(951, 1000) == Fit(False, 1)
    assert check_fit(9500, 10000) == Fit(True, 0)
    assert check_fit(217907, 229376) == Fit(True, 0)
    assert check_fit(217908, 229376) == Fit(False, 1)
    with pytest.raises(ValueError):
        check_fit(1, 10, margin=1.0)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 300000), st.integers(1, 262144), st.integers(0, 300000),
    st.floats(0.0, 1.0), st.booleans(),
)
def test_decide_never_fires_below_threshold_or_twice(
    tokens: int, budget_: int, compactable: int, threshold: float, pending: bool
) -> None:
    policy = Policy(threshold=threshold)
    decision, memory = decide(Observation(tokens, budget_, compactable, 0.0),
                              SessionMemory(pending=pending), policy)
    if decision.fire:
        assert threshold > 0 and tokens >= threshold * budget_ and not pending
        assert memory.pending
        # Past the cooldown, within the pending expiry: still not twice.
        again, _ = decide(Observation(tokens, budget_, compactable, 100.0), memory, policy)
        assert not again.fire


# --- The third seed's oscillation, replayed --------------------------------------------

WINDOW = 262144
CHARS_PER_TOKEN = 7.5  # the rig's measured ratio for AILANG code and DOCX XML
# What the provider reported per call: full history, compacted, full, ... (seed 3).
REPORTED = [246429, 103830, 254162, 104257, 261021, 105690, 267365]
# The uncompacted history grew the whole time; between two full calls, interpolate.
FULL_HISTORY = [246429, 250296, 254162, 257592, 261021, 264193, 267365]
COMPACTED = [103830, 103830, 104044, 104257, 104974, 105690, 106528]


def old_rule_fires(last_reported: int | None) -> bool:
    """The seed's trigger: the provider's previous count >= 60% of (window - 75k)."""
    return last_reported is not None and last_reported >= 0.6 * (WINDOW - 75000)


def test_old_rule_oscillates_into_overflow() -> None:
    last: int | None = None
    sent = []
    for step, full in enumerate(FULL_HISTORY):
        tokens = COMPACTED[step] if old_rule_fires(last) else full
        sent.append(tokens)
        last = tokens
    assert sent == REPORTED  # the trajectory the seed recorded
    # After every compacted call the old rule reads a low count and stays quiet, so the
    # full history goes out again, creeping up until it overflows the window.
    assert [old_rule_fires(r) for r in REPORTED[1::2]] == [False, False, False]
    assert sent[-1] > WINDOW


def test_estimate_of_what_is_about_to_be_sent_fires_every_time() -> None:
    limit = budget(WINDOW, default_headroom(WINDOW))
    policy, memory = Policy(), SessionMemory()
    # The run was long under way: an earlier call had calibrated the ratio.
    calibration = calibrate(Calibration(), 200000, round(200000 * CHARS_PER_TOKEN), WINDOW)
    sent = []
    for step, full in enumerate(FULL_HISTORY):
        full_chars = round(full * CHARS_PER_TOKEN)
        compacted_chars = round(COMPACTED[step] * CHARS_PER_TOKEN)
        estimate = estimate_tokens(full_chars, calibration)
        compactable = estimate - estimate_tokens(compacted_chars, calibration)
        now = 60.0 * step
        decision, memory = decide(Observation(estimate, limit, compactable, now), memory, policy)
        # The full history is about to be sent on every step: the decision must fire,
        # and the guard agrees it would not fit.
        assert decision.fire, (step, decision.reason)
        assert not check_fit(estimate, limit).fits
        memory = on_result(memory, COMPACTED[step], now)
        sent_chars, tokens = compacted_chars, COMPACTED[step]
        assert check_fit(estimate_tokens(sent_chars, calibration), limit).fits
        sent.append(tokens)
        calibration = calibrate(calibration, tokens, sent_chars, WINDOW)
    assert all(tokens <= limit for tokens in sent)
    assert calibration.tokens_per_char == pytest.approx(1 / CHARS_PER_TOKEN, rel=1e-3)


# --- Relief: the summary is rewritten, not freed ----------------------------------------

RELIEF_NUM_CTX = 8192
NOTES = "N" * 3200  # about 800 tokens of notes, 11% of the budget


def paste_and_chat(first: int, count: int) -> tuple[ChatMessage, ...]:
    """Turns alternating a 10,400-character paste and a short remark."""
    out: list[ChatMessage] = []
    for i in range(first, first + count):
        out += [ChatMessage(role="user", content=f"#{i} " + "p" * (10400 if i % 2 else 20)),
                ChatMessage(role="assistant", content="ok")]
    return tuple(out)


def observe(conversation: Conversation, now: float, calibration: Calibration,
            policy: Policy) -> tuple[Observation, Level | None]:
    """What the decider sees of this history, as the generator's report sizes it."""
    limit = prompt_budget(RELIEF_NUM_CTX)
    weights = HistoryWeights.of("", conversation)
    whole = next_prompt_size("", conversation)
    estimate = context_tokens(whole, calibration)
    level = level_for(estimate, limit, policy)
    boundary = choose_boundary(conversation.messages, tail_turns_for(level or Level.gentle, 4))
    return Observation(
        estimate, limit, part_tokens(whole, weights.compactable(boundary), calibration), now,
        summary_tokens=part_tokens(whole, weights.summary, calibration),
        summary_allowance=summary_allowance(RELIEF_NUM_CTX, calibration),
    ), level


def test_a_compaction_that_only_rewrites_the_summary_is_vetoed() -> None:
    # 85% of the budget, of which 800 tokens of notes and one short turn before the
    # gentle live zone: compacting would rewrite the notes and free a dozen tokens.
    calibration, policy = Calibration(0.25), Policy()
    conversation = Conversation(summary=NOTES, messages=paste_and_chat(0, 5), compactions=1)
    obs, level = observe(conversation, 0.0, calibration, policy)
    assert level is Level.gentle
    assert obs.compactable_tokens > policy.min_relief * obs.budget  # the old "freeable"
    decision, _ = decide(obs, SessionMemory(), policy)
    assert not decision.fire and "not worth it" in decision.reason
    assert obs.relief_tokens == 0


def test_no_refiring_every_cooldown_once_no_raw_turn_is_left() -> None:
    """Paste, chat, paste...: each paste is compacted at emergency, then the session sits
    at 85% with nothing raw before its live zone. It fires once per real relief only."""
    calibration, policy = Calibration(0.25), Policy()
    conversation = Conversation(summary=NOTES, messages=paste_and_chat(0, 4), compactions=1)
    memory, now, fired = SessionMemory(), 0.0, []
    for i in range(4, 16):
        conversation = conversation.model_copy(
            update={"messages": (*conversation.messages, *paste_and_chat(i, 1))})
        obs, level = observe(conversation, now, calibration, policy)
        decision, memory = decide(obs, memory, policy)
        if decision.fire:
            assert level is not None
            plan = plan_compaction(conversation, tail_turns_for(level, 4))
            assert plan is not None, f"fired with nothing before the live zone: {decision}"
            spliced = splice(conversation, plan, NOTES)
            conversation = Conversation(summary=spliced.summary, messages=spliced.messages,
                                        compactions=spliced.compactions)
            after, _ = observe(conversation, now, calibration, policy)
            freed = obs.next_prompt_tokens - after.next_prompt_tokens
            assert freed >= policy.min_relief * obs.budget, (freed, decision.reason)
            fired.append(level)
            memory = on_result(memory, after.next_prompt_tokens, now + 40)
        now += 45.0
    # One emergency compaction per paste that pushes the session over 95%, nothing else.
    assert fired and set(fired) == {Level.emergency}


def test_an_answer_using_all_its_room_stays_in_the_window_whatever_the_estimates_error() -> None:
    """At the raw estimate, a prompt counted a few tokens over it and an answer
    using all its room ran past the window (by 1 to 3 tokens in a soak)."""
    for num_ctx, headroom in ((2048, 256), (8192, 1024), (4096, 0)):
        budget = num_ctx - headroom
        for estimate in range(0, budget + 1, 7):
            if not check_fit(estimate, budget).fits:
                continue  # never sent
            room = answer_room(num_ctx, budget, estimate)
            truly_at_most = math.floor(estimate / (1.0 - FIT_MARGIN))  # the error reserved for
            assert truly_at_most + room <= num_ctx, (num_ctx, estimate)
            assert room >= headroom
