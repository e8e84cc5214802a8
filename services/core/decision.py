"""When to compact (the decider's brain) and the generator's last guard.

Decisions are taken on the calibrated estimate of what the NEXT call will
send, never on the provider's last reported count alone: after a compacted
call that count is low although the history about to be sent may be full,
which is how a trigger driven by it oscillates into overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from schemas.messages import Level

# At or above this share of the budget the level is emergency, whatever the
# threshold: the next call would leave almost no slack.
EMERGENCY_FRACTION = 0.95

# The share of the budget the generator's last guard keeps in reserve. A
# calibrated estimate still errs by a few percent when the mix of the prompt
# shifts (framing is charged per message, in tokens, while the estimate counts
# characters; compaction swaps big messages for small ones): the simulation
# measures it at under 5% near the top. Sending only up to the emergency line
# absorbs that, so no prompt's true size exceeds the budget.
FIT_MARGIN = 1.0 - EMERGENCY_FRACTION

# How long after a compaction's result a report measured before it may still
# be stored: its turn ended before the compaction took the lock, and its
# report goes out without waiting, so only a slow publish, or the clocks of a
# cluster's servers, put it after the result.
STALE_REPORT_GRACE_S = 5.0
CONTRADICTIONS_BELIEVED = 2


@dataclass(frozen=True)
class Policy:
    threshold: float = 0.8
    cooldown_s: float = 30.0
    min_relief: float = 0.1
    # How long a request may go unanswered before it counts as lost (its
    # publish or its result went astray) and the session may be asked for again.
    pending_expiry_s: float = 660.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be within [0, 1], got {self.threshold}")
        if self.cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if not 0.0 <= self.min_relief <= 1.0:
            raise ValueError(f"min_relief must be within [0, 1], got {self.min_relief}")
        if self.pending_expiry_s <= 0:
            raise ValueError(f"pending_expiry_s must be > 0, got {self.pending_expiry_s}")

    @property
    def tighter_fraction(self) -> float:
        """Halfway between the threshold and a full budget."""
        return self.threshold + (1.0 - self.threshold) / 2


@dataclass(frozen=True)
class Observation:
    next_prompt_tokens: int
    budget: int
    # Everything a compaction at the level replaces: the messages before its
    # live zone and the existing summary (`summary_tokens` of it).
    compactable_tokens: int
    now: float
    summary_tokens: int = 0
    # The most the summary it writes may take (`context.summary_allowance`).
    summary_allowance: int = 0
    # How many compactions the measured history had been through (None: unknown).
    compactions: int | None = None

    @property
    def relief_tokens(self) -> int:
        """What the compaction is expected to free: what it replaces, less the
        summary it writes. That summary is sized at its bound, and at least as
        large as the one it replaces, since it merges it: the existing summary
        is rewritten by a compaction, not freed."""
        written = max(self.summary_tokens, self.summary_allowance)
        return max(0, self.compactable_tokens - written)


@dataclass(frozen=True)
class SessionMemory:
    # A request is out and unanswered; it was sent at `last_fired_at`.
    pending: bool = False
    last_fired_at: float | None = None
    # The most compactions a result said the history had been through, and
    # when that result was stored (stream time, in seconds; None: unknown).
    compactions: int = 0
    compacted_at: float | None = None
    # Reports in a row, stored past the grace, that said fewer compactions.
    contradictions: int = 0


@dataclass(frozen=True)
class Decision:
    fire: bool
    level: Level | None
    reason: str


@dataclass(frozen=True)
class Fit:
    fits: bool
    over_by: int


def level_for(next_prompt_tokens: int, budget: int, policy: Policy) -> Level | None:
    """How hard to compact for this estimate, or None below the threshold (or disabled).

    Callers size `Observation.compactable_tokens` for this level's live zone.
    """
    if policy.threshold <= 0 or budget <= 0:
        return None
    if next_prompt_tokens < policy.threshold * budget:
        return None
    if next_prompt_tokens >= EMERGENCY_FRACTION * budget:
        return Level.emergency
    if next_prompt_tokens >= policy.tighter_fraction * budget:
        return Level.tighter
    return Level.gentle


def decide(
    obs: Observation, memory: SessionMemory, policy: Policy
) -> tuple[Decision, SessionMemory]:
    """Whether to request a compaction now, and the session's updated memory.

    The memory returned with a firing says a request is pending: keep it only
    once the request is confirmed stored, so a publish that failed leaves the
    session free to be asked for on its next report.
    """
    if policy.threshold <= 0:
        return Decision(False, None, "automatic compaction is disabled (threshold 0)"), memory
    if obs.compactions is not None and obs.compactions < memory.compactions:
        # Read after the result of a compaction it predates: its sizes are gone.
        return Decision(False, None, f"measured after {obs.compactions} compaction(s), "
                        f"before the latest ({memory.compactions}): out of date"), memory
    usage = _usage(obs, policy)
    level = level_for(obs.next_prompt_tokens, obs.budget, policy)
    if level is None:
        return Decision(False, None, f"{usage}: below threshold"), memory
    veto = _veto(obs, memory, policy, level)
    if veto is not None:
        return Decision(False, None, f"{usage}, {level.value}, but {veto}"), memory
    fired = replace(memory, pending=True, last_fired_at=obs.now)
    lost = " again: the last request got no result in time" if memory.pending else ""
    return Decision(True, level, f"{usage}: compact ({level.value}){lost}"), fired


def _usage(obs: Observation, policy: Policy) -> str:
    share = obs.next_prompt_tokens / obs.budget if obs.budget > 0 else float("inf")
    relation = ">=" if obs.next_prompt_tokens >= policy.threshold * obs.budget else "<"
    return (
        f"estimate {obs.next_prompt_tokens} of budget {obs.budget} tokens "
        f"({share:.0%}) {relation} threshold {policy.threshold:.0%}"
    )


def _veto(obs: Observation, memory: SessionMemory, policy: Policy, level: Level) -> str | None:
    """Why a compaction must not start although the estimate crossed, if it must not."""
    # One compaction in flight per session, whatever the level: a second one
    # would only conflict with the first at splice time.
    if awaits_result(memory, obs.now, policy):
        return "a compaction is already pending for this session"
    # Emergency ignores the cooldown: overflow is worse than a second summary.
    if level is not Level.emergency and memory.last_fired_at is not None:
        elapsed = obs.now - memory.last_fired_at
        if elapsed < policy.cooldown_s:
            return (
                f"cooling down ({elapsed:.1f}s since the last one, "
                f"cooldown {policy.cooldown_s:g}s)"
            )
    needed = policy.min_relief * obs.budget
    relief = obs.relief_tokens
    # Nothing to free is never worth a model call, whatever the minimum.
    if relief < needed or relief <= 0:
        return (
            f"a compaction would free about {relief} tokens ({obs.compactable_tokens} outside "
            f"the live zone, summary included, less a summary of up to "
            f"{max(obs.summary_tokens, obs.summary_allowance)}), less than the minimum relief "
            f"of {needed:.0f} ({policy.min_relief:.0%} of budget): not worth it"
        )
    return None


def awaits_result(memory: SessionMemory, now: float, policy: Policy) -> bool:
    """A request is out and may still be answered. One unanswered for
    `pending_expiry_s` is taken as lost (its result missed, or the request
    itself), so a missed message cannot turn automatic compaction off for good."""
    if not memory.pending:
        return False
    if memory.last_fired_at is None:
        return True
    return now - memory.last_fired_at < policy.pending_expiry_s


def on_result(memory: SessionMemory, tokens_after: int | None, now: float) -> SessionMemory:
    """The result of this decider's request arrived (any outcome): nothing is
    pending any more.

    A failed compaction (no `tokens_after`) restarts the cooldown at `now`, so a
    broken summariser is retried once per cooldown rather than on every turn.
    """
    last = now if tokens_after is None else memory.last_fired_at
    return replace(memory, pending=False, last_fired_at=last)


def on_compacted(memory: SessionMemory, compactions: int | None,
                 stored_at: float | None = None) -> SessionMemory:
    """Any completed compaction's result, whoever asked for it: reports
    measured before it are out of date from now on."""
    if compactions is None or compactions <= memory.compactions:
        return memory
    return replace(memory, compactions=compactions, compacted_at=stored_at, contradictions=0)


def on_report(memory: SessionMemory, compactions: int | None, stored_at: float | None,
              grace_s: float = STALE_REPORT_GRACE_S) -> SessionMemory:
    """The memory once a report is read. A report measured before the latest
    compaction is stored moments after its result at most; reports stored
    long after it, with fewer compactions, show the count is wrong (a history
    deleted and begun again under the same id, or a result that claimed too
    many), so that count gives way rather than pass over every report to come.
    Two in a row: one measured before, held up on its way (a publisher cut
    off from NATS sends it once it is back), is no proof."""
    if compactions is None or compactions >= memory.compactions:
        return replace(memory, contradictions=0) if memory.contradictions else memory
    if memory.compacted_at is None or stored_at is None:
        return memory
    if stored_at < memory.compacted_at + grace_s:
        return memory
    if memory.contradictions + 1 < CONTRADICTIONS_BELIEVED:
        return replace(memory, contradictions=memory.contradictions + 1)
    return replace(memory, compactions=compactions, compacted_at=stored_at, contradictions=0)


def check_fit(next_prompt_tokens: int, budget: int, margin: float = FIT_MARGIN) -> Fit:
    """The generator's pre-send guard: does the next call fit its budget, keeping
    `margin` of it in reserve for the estimate's error? `over_by` is how many
    estimated tokens must go for it to fit."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be within [0, 1), got {margin}")
    limit = math.floor((1.0 - margin) * budget)
    over = next_prompt_tokens - limit
    return Fit(fits=over <= 0, over_by=max(0, over))


def answer_room(num_ctx: int, budget: int, prompt_estimate: int,
                margin: float = FIT_MARGIN) -> int:
    """The most tokens the answer may take (`num_predict`): what the prompt
    leaves of the window, the prompt priced as it may truly be (its estimate
    over 1 - `margin`, the error `check_fit` keeps in reserve; at the raw
    estimate, an answer using all its room ran past the window by the
    estimate's error), and never less than the headroom the budget keeps."""
    worst = math.ceil(prompt_estimate / (1.0 - margin))
    return max(num_ctx - worst, num_ctx - budget)
