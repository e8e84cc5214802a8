"""A seeded, deterministic world over the pure core (no asyncio, no I/O).

One scenario is one session: a provider with its own tokenizer ratio and
quirks, a scripted user and tools, a "generator" that renders, estimates,
guards and sends every call, and a "decider" that watches each call and
starts background compactions which splice some turns later, racing the
turns in between. After every step the invariants of the design are checked;
the first violation raises `InvariantViolation` naming the seed.

Every message carries a unique id (`#<n>:` at the start of its content) so the
simulation can prove that nothing appended is ever lost or duplicated: each id
is either raw in the history or covered by the current (stacked) summary.

Modelling choices, mirroring the stand-in Ollama and what the shells must do:
- the provider's prompt cache holds the previous request (a chat call or a
  summary); with the cache-count quirk a prompt is charged only for what
  follows its longest common prefix with it, and the generator passes the part
  that may be cached (`prompt_cache`, read off the history as any generator
  would) to `calibrate` so such counts are not mistaken for whole-prompt ones;
- the "mixed" family sends prose, code, JSON tool output and CJK text in one
  session, to a tokenizer that charges ASCII and CJK characters at rates of
  their own, drawn per scenario. Dense text is charged cautiously until the
  provider has counted some, so there the premature-compaction checks give
  way to a record of the estimate's error both ways;
- a turn's messages are appended only when the turn completes, so a refused
  turn leaves no trace in the history;
- the generator's own emergency compaction does not clear the decider's
  pending flag: the decider reacts only to the result of its own request
  (correlate `compaction.result` with the request), else a second background
  compaction could start beside a doomed one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.history import ChatMessage, Conversation, Role, Snapshot, ToolCall
from schemas.messages import Level
from services.core.boundary import choose_boundary, tail_turns_for
from services.core.context import part_tokens, summary_allowance
from services.core.decision import (
    EMERGENCY_FRACTION,
    Observation,
    Policy,
    SessionMemory,
    check_fit,
    decide,
    level_for,
    on_result,
)
from services.core.overflow import FitsShare, best_case_prompt, cut_tool_output
from services.core.pieces import NothingFits, SummaryWindow, Zone, next_piece
from services.core.prompt import compact_json, render_messages
from services.core.prompt_cache import cached_size, common_prefix, previous_call
from services.core.splice import (
    CompactionPlan,
    SpliceConflict,
    first_user_request,
    plan_compaction,
    splice,
)
from services.core.state_machine import (
    INITIAL,
    Action,
    CompactionMode,
    IllegalTransition,
    Phase,
    SessionState,
    transition,
)
from services.core.summary_prompt import SUMMARY_MARKER
from services.core.text_size import HistoryWeights, Size, prompt_size
from services.core.tokens import (
    Calibration,
    budget,
    calibrate,
    default_headroom,
    estimate_size,
)

Msg = dict[str, Any]

REPLAY_HINT = "SIM_SEED={seed} pytest tests/core/test_simulation.py -k replay"

# Like the stand-in: every message costs 4 template tokens beyond its text, and
# with prompt-cache counting a suffix under 5 tokens is not reported at all.
PROVIDER_OVERHEAD_TOKENS = 4
CACHE_MIN_TOKENS = 5
NUM_CTX_SIZES = (1024, 2048, 2048, 4096, 4096, 8192)
# How far below the threshold a decider firing may be (the estimate's error).
PREMATURE_SLACK = 0.05
CJK = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 200))  # common ideographs
WORDS = ("the", "model", "reads", "a", "file", "and", "then", "answers", "with", "care",
         "context", "window", "summary", "session", "turn", "token", "of", "in", "to")
# The generator's guard acts at the emergency line, on an estimate that errs
# both ways by up to about 6.5%: it must never compact below 85% of the budget.
GUARD_SLACK = 0.10
# A decider's compaction frees at least the minimum relief, less this share of
# it: the relief is judged on estimates, and the ratio may move a little
# between the request and the splice.
RELIEF_SLACK = 0.10
TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                      "parameters": {"path": {"type": "string"}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the code",
                                      "parameters": {"q": {"type": "string"}}}},
)


class InvariantViolation(AssertionError):
    def __init__(self, seed: int, step: str, what: str) -> None:
        super().__init__(
            f"seed {seed}, {step}: {what}\n  replay: {REPLAY_HINT.format(seed=seed)}"
        )
        self.seed = seed


# --------------------------------------------------------------------------- the world


@dataclass(frozen=True)
class Scenario:
    seed: int
    num_ctx: int
    chars_per_token: float
    missing_rate: float
    cache_counts: bool
    eviction_rate: float
    truncates: bool
    mode: CompactionMode
    policy: Policy
    tail_turns: int
    turns: int
    system: str
    # The summariser merges the earlier notes and writes up to its output
    # budget, instead of a few short lines.
    verbose_notes: bool
    mixed: bool = False
    dense_tokens: float = 0.0  # mixed family: a CJK character

    @classmethod
    def draw(cls, seed: int, rng: random.Random) -> Scenario:
        policy = Policy(
            threshold=rng.choice((0.0, 0.6, 0.7, 0.8, 0.8, 0.9)),
            cooldown_s=rng.choice((0.0, 30.0, 120.0)),
            min_relief=rng.choice((0.05, 0.1, 0.2)),
            # This world loses no result, and a compaction here may stay in
            # flight for many simulated minutes: a request never expires.
            pending_expiry_s=math.inf,
        )
        return cls(
            seed=seed,
            num_ctx=rng.choice(NUM_CTX_SIZES),
            chars_per_token=rng.uniform(2.5, 8.0),
            missing_rate=rng.choice((0.0, 0.0, 0.2, 1.0)),
            cache_counts=rng.random() < 0.5,
            eviction_rate=rng.choice((0.0, 0.1, 0.5)),
            truncates=rng.random() < 0.5,
            mode=CompactionMode.blocking if rng.random() < 0.2 else CompactionMode.background,
            policy=policy,
            tail_turns=rng.choice((1, 2, 4, 8)),
            turns=rng.randint(30, 80),
            system="You are a careful assistant. " * rng.randint(1, 6),
            verbose_notes=rng.random() < 0.5,
            **cls.draw_mix(rng),
        )

    @staticmethod
    def draw_mix(rng: random.Random) -> dict[str, Any]:
        """A third of the scenarios mix scripts and content kinds in one session."""
        if rng.random() >= 1 / 3:
            return {}
        return {"mixed": True, "dense_tokens": rng.uniform(0.5, 1.0)}

    @property
    def headroom(self) -> int:
        return default_headroom(self.num_ctx)

    @property
    def budget(self) -> int:
        return budget(self.num_ctx, self.headroom)

    @property
    def summary_num_ctx(self) -> int:
        """COMPACTION_NUM_CTX: every fourth seed summarises with half the window
        (at least 2,048), as another, smaller model would."""
        if self.seed % 4 == 0 and self.num_ctx >= 4096:
            return max(2048, self.num_ctx // 2)
        return self.num_ctx

    @property
    def window_chars(self) -> int:
        return int(self.num_ctx * self.chars_per_token)


class Provider:
    """Ollama as the stand-in models it: exact counts, then the scenario's quirks."""

    def __init__(self, sc: Scenario, rng: random.Random) -> None:
        self.sc = sc
        self.rng = rng
        self.cached: list[Msg] | None = None
        self.memo: dict[str, int] = {}

    def text_tokens(self, text: str) -> float:
        sc = self.sc
        if not sc.mixed:
            return len(text) / sc.chars_per_token
        # Every non-ASCII character the script writes is a three-byte CJK one.
        dense = 0 if text.isascii() else (len(text.encode()) - len(text)) // 2
        return (len(text) - dense) / sc.chars_per_token + dense * sc.dense_tokens

    def message_tokens(self, message: Msg) -> int:
        # Every message's content starts with its unique id: a key for the memo.
        content = message.get("content") or ""
        known = self.memo.get(content)
        if known is None:
            text = content
            if message.get("tool_calls"):
                text += compact_json(message["tool_calls"])
            known = math.ceil(self.text_tokens(text)) + PROVIDER_OVERHEAD_TOKENS
            self.memo[content] = known
        return known

    def true_tokens(self, messages: Sequence[Msg], tools: Sequence[Msg] = TOOLS) -> int:
        offered = math.ceil(self.text_tokens(compact_json(list(tools)))) if tools else 0
        return sum(self.message_tokens(m) for m in messages) + offered

    def summarise(self, request: list[Msg]) -> None:
        """A summary request goes to the same server and takes its cache."""
        self.cached = request

    def report(self, messages: list[Msg]) -> int | None:
        """The prompt_eval_count Ollama would return for this call."""
        true = self.true_tokens(messages)
        previous, self.cached = self.cached, messages
        if self.sc.truncates and true > self.sc.num_ctx:
            return self.sc.num_ctx  # silently truncated: the count is capped
        if self.rng.random() < self.sc.missing_rate:
            return None
        evicted = self.rng.random() < self.sc.eviction_rate
        shared = common_prefix(previous or [], messages)
        if self.sc.cache_counts and shared and not evicted:
            rest = sum(self.message_tokens(m) for m in messages[shared:])
            return None if rest < CACHE_MIN_TOKENS else rest
        return true


class Script:
    """What the user and the tools say: sizes drawn from the scenario's rng."""

    def __init__(self, sc: Scenario, rng: random.Random) -> None:
        self.sc = sc
        self.rng = rng
        self.next_id = 0

    def text(self, chars: int, kind: str = "prose") -> str:
        self.next_id += 1
        head = f"#{self.next_id}:"
        if not self.sc.mixed:
            return head + "x" * max(0, chars - len(head))
        body = self.mixed_text(kind, max(0, chars - len(head)))
        return head + body

    def mixed_text(self, kind: str, chars: int) -> str:
        """About `chars` characters of one kind of content."""
        rng, pieces, size = self.rng, [], 0
        while size < chars:
            if kind == "code":
                piece = (f"def f_{rng.randint(1, 99)}(x, y):\n"
                         f"    return x * {rng.randint(2, 9)} + y\n")
            elif kind == "json":
                piece = (f'{{"id": {rng.randint(1, 9999)}, "path": "src/m{rng.randint(1, 99)}.py",'
                         f' "ok": true, "tags": ["a", "b"]}}, ')
            elif kind == "cjk":
                start = rng.randrange(len(CJK) - 12)
                piece = CJK[start:start + 12] + "。"
            else:
                start = rng.randrange(len(WORDS) - 8)
                piece = " ".join(WORDS[start:start + 8]) + ". "
            pieces.append(piece)
            size += len(piece)
        return "".join(pieces)[:chars]

    def kind(self, *kinds: str) -> str:
        return self.rng.choice(kinds) if self.sc.mixed else "prose"

    def message(self, role: Role, chars: int, kind: str = "prose", **fields: Any) -> ChatMessage:
        """A message whose id is in its content and in `query_id` (which a cut
        to the marker alone leaves in place)."""
        content = self.text(chars, kind)
        return ChatMessage(role=role, content=content, query_id=str(self.next_id), **fields)

    def size(self, big_share: float) -> int:
        if self.rng.random() < big_share:
            # Up to 40% of the window, mostly far less.
            return 10 + int(0.4 * self.sc.window_chars * self.rng.random() ** 2)
        return self.rng.randint(10, 400)

    def user(self) -> ChatMessage:
        return self.message("user", self.size(0.15), self.kind("prose", "cjk", "code"))

    def tool_call(self) -> ChatMessage:
        name = self.rng.choice(("read_file", "search"))
        args = {"path": f"src/m{self.rng.randint(1, 99)}.py"}
        return self.message("assistant", self.rng.randint(0, 80),
                            tool_calls=(ToolCall(name=name, arguments=args),))

    def tool_result(self, name: str, timed_out: bool) -> ChatMessage:
        if timed_out:
            return self.message("tool", 40, tool_name=name)
        chars = self.size(0.3)
        if self.rng.random() < 0.01:
            chars = int(1.2 * self.sc.window_chars)  # a single result larger than the window
        return self.message("tool", chars, self.kind("json", "code", "prose"), tool_name=name)

    def answer(self) -> ChatMessage:
        most = max(20, int(0.5 * self.sc.headroom * self.sc.chars_per_token))
        if self.sc.mixed:  # an answer must fit the room kept for it, in any script
            most = max(20, int(0.5 * self.sc.headroom))
        return self.message("assistant", self.rng.randint(10, most),
                            self.kind("prose", "cjk", "code"))


def message_id(message: ChatMessage) -> int:
    assert message.query_id is not None
    return int(message.query_id)


# --------------------------------------------------------------------------- bookkeeping


@dataclass
class InFlight:
    plan: CompactionPlan
    level: Level
    splice_before_turn: int
    # Requested by the decider once calibrated: it must free the minimum relief.
    worth_checking: bool = False


@dataclass
class Stats:
    calls: int = 0
    refused_turns: int = 0
    decider_firings: int = 0
    emergency_compactions: int = 0
    splices: int = 0
    conflicts: int = 0
    rejected_queries: int = 0
    max_fill: float = 0.0  # highest true prompt tokens / budget sent
    summary_calls: int = 0
    summaries_cut_off: int = 0  # answers at their length limit, written again
    summaries_in_pieces: int = 0  # zones larger than one summariser call
    entries_cut: int = 0  # single entries too large for any piece, cut
    max_summary_fill: float = 0.0  # highest true summary prompt / the summariser's budget
    hopeless_refusals: int = 0  # refused at once: no compaction could have made room
    tool_results_cut: int = 0
    max_underestimate: float = 0.0  # highest true/estimate - 1 over calibrated calls
    max_overestimate: float = 0.0  # highest estimate/true - 1 over calibrated calls
    mixed_calls: int = 0
    # The same two over the calls of mixed sessions, and how many of those
    # calls were estimated within 5 % both ways.
    mixed_underestimate: float = 0.0
    mixed_overestimate: float = 0.0
    mixed_within_5pct: int = 0
    # Mixed calls made once the provider had counted dense text in two prompts
    # of different make-up (both rates learnt), and how many were within 5 %.
    learnt_calls: int = 0
    learnt_within_5pct: int = 0
    # Lowest (true fill - the line it acts on) at which a calibrated decider or
    # guard compaction fired; the invariants allow -5% and -10%.
    decider_excess: float = math.inf
    guard_excess: float = math.inf
    # Least (true tokens freed / minimum relief) of a calibrated decider's compaction.
    least_relief: float = math.inf


@dataclass
class Session:
    """Everything the generator and the decider keep for the one session."""

    history: Conversation = field(default_factory=Conversation)
    calibration: Calibration = field(default_factory=Calibration)
    # The call before the next one, as the generator knows it: read off the
    # history when a turn starts, then the turn's own previous call.
    previous_call: list[Msg] = field(default_factory=list)
    state: SessionState = INITIAL
    memory: SessionMemory = field(default_factory=SessionMemory)
    in_flight: InFlight | None = None
    queued: InFlight | None = None  # blocking mode: runs at the next idle point
    covered: dict[str, frozenset[int]] = field(default_factory=dict)
    appended: set[int] = field(default_factory=set)
    last_fire_turn: int | None = None
    last_fire_level: Level | None = None
    completed_since_fire: bool = True
    now: float = 0.0


# --------------------------------------------------------------------------- the run


class Simulation:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        self.sc = Scenario.draw(seed, rng)
        self.rng = rng
        self.provider = Provider(self.sc, rng)
        self.script = Script(self.sc, rng)
        self.s = Session()
        self.stats = Stats()
        self.turn = 0
        self.summaries = 0

    def fail(self, what: str) -> InvariantViolation:
        return InvariantViolation(self.seed, f"turn {self.turn}", what)

    def run(self) -> Stats:
        for turn in range(self.sc.turns):
            self.turn = turn
            self.between_turns()
            self.one_turn()
            self.check_history()
            self.check_idle()
        return self.stats

    # ----------------------------------------------------------------- state machine

    def act(self, action: Action) -> None:
        try:
            self.s.state = transition(self.s.state, action, self.sc.mode)
        except IllegalTransition as err:
            raise self.fail(f"illegal transition in the simulated shell: {err}") from err

    def check_idle(self) -> None:
        want_flag = self.sc.mode is CompactionMode.background and self.s.in_flight is not None
        if self.s.state != SessionState(Phase.idle, want_flag):
            raise self.fail(f"between turns the state is {self.s.state}, flag {want_flag}")

    # ----------------------------------------------------------------- a turn

    def one_turn(self) -> None:
        self.act(Action.receive)
        self.act(Action.start_generation)
        self.s.previous_call = previous_call(
            self.sc.system, self.s.history, self.s.calibration.tokens_per_char is not None)
        pending = [self.script.user()]
        for _ in range(self.rng.choice((0, 0, 1, 1, 2, 3))):
            call = self.script.tool_call()
            if not self.call_model(pending, call):
                return self.refuse()
            pending.append(call)
            self.act(Action.dispatch_tool)
            self.act(Action.await_result)
            timed_out = self.rng.random() < 0.05
            pending.append(self.script.tool_result(call.tool_calls[0].name, timed_out))
            self.act(Action.tool_timeout if timed_out else Action.tool_result)
        answer = self.script.answer()
        if not self.call_model(pending, answer):
            return self.refuse()
        pending.append(answer)
        self.act(Action.publish)
        self.append(pending)
        self.act(Action.reset)
        return None

    def refuse(self) -> None:
        """The turn cannot fit even after an emergency compaction: a clear error."""
        self.stats.refused_turns += 1
        self.act(Action.fail)
        self.act(Action.reset)

    def append(self, messages: Sequence[ChatMessage]) -> None:
        history = self.s.history
        self.s.history = history.model_copy(update={"messages": (*history.messages, *messages),
                                                    "just_compacted": False})
        self.s.appended.update(message_id(m) for m in messages)

    def render(self, pending: Sequence[ChatMessage]) -> tuple[list[Msg], Size]:
        messages = render_messages(self.sc.system, self.s.history, pending)
        return messages, prompt_size(messages, TOOLS)

    def call_model(self, pending: list[ChatMessage], reply: ChatMessage) -> bool:
        """The generator's pre-send guard, the call itself, then the decider."""
        messages, size = self.render(pending)
        estimate = estimate_size(size, self.s.calibration)
        if not check_fit(estimate, self.sc.budget).fits:
            if not self.make_room(pending):
                return False  # not sent, and the turn's messages are never appended
            messages, size = self.render(pending)
            estimate = estimate_size(size, self.s.calibration)
        self.send(messages, size, estimate)
        self.decider_step([*pending, reply])
        return True

    def fits(self, messages: list[Msg], share: float = 1.0) -> bool:
        estimate = estimate_size(prompt_size(messages, TOOLS), self.s.calibration)
        return check_fit(estimate, int(share * self.sc.budget)).fits

    def make_room(self, pending: list[ChatMessage]) -> bool:
        """As the generator's turn does: an emergency compaction only when its
        best outcome fits (a tool result too large for even that is cut first),
        then the turn's tool results cut if the prompt is still over."""
        tail = tail_turns_for(Level.emergency, self.sc.tail_turns)

        def best_fits(turn: Sequence[ChatMessage], share: float) -> bool:
            return self.fits(best_case_prompt(self.sc.system, self.s.history, turn, tail), share)

        if self.cut_results(pending, best_fits):
            messages, _ = self.render(pending)
            if not self.fits(messages):
                true = self.provider.true_tokens(messages)
                self.check_not_premature(true, "generator emergency", EMERGENCY_FRACTION,
                                         GUARD_SLACK)
                self.stats.guard_excess = min(self.stats.guard_excess,
                                              self.excess(true, EMERGENCY_FRACTION))
                self.emergency_compaction()
        else:
            self.stats.hopeless_refusals += 1  # nothing compacted, no summariser call
            return False
        if self.fits(self.render(pending)[0]):
            return True
        return self.cut_results(pending, lambda turn, share: self.fits(
            render_messages(self.sc.system, self.s.history, turn), share))

    def cut_results(self, pending: list[ChatMessage], fits: FitsShare) -> bool:
        """The turn's tool results cut if it does not fit; their ids stay."""
        cut = cut_tool_output(pending, fits)
        if cut is None:
            return False
        if [message_id(m) for m in cut] != [message_id(m) for m in pending]:
            raise self.fail("cutting the turn's tool output lost or reordered a message")
        if list(cut) != pending:
            self.stats.tool_results_cut += 1
            if not all("characters left out here" in m.content
                       for m, was in zip(cut, pending, strict=True) if m != was):
                raise self.fail("a tool result was cut without a marker")
        pending[:] = cut
        return True

    def send(self, messages: list[Msg], size: Size, estimate: int) -> None:
        sc = self.sc
        if messages[0] != {"role": "system", "content": sc.system}:
            raise self.fail("the system prompt was not sent first and unchanged")
        true = self.provider.true_tokens(messages)
        if true > sc.budget:
            raise self.fail(
                f"prompt of {true} true tokens sent over the budget {sc.budget} "
                f"(estimate {estimate}, calibration {self.s.calibration})"
            )
        self.stats.calls += 1
        self.stats.max_fill = max(self.stats.max_fill, true / sc.budget)
        if self.s.calibration.reports:
            self.check_estimate(true, estimate)
        reported = self.provider.report(messages)
        reused = cached_size(self.s.previous_call, messages, TOOLS, size)
        self.s.calibration = calibrate(
            self.s.calibration, reported, size.chars, sc.num_ctx, messages=size.messages,
            extra_bytes=size.extra_bytes, reused_chars=reused.chars,
            reused_extra_bytes=reused.extra_bytes, reused_messages=reused.messages)
        self.s.previous_call = messages
        self.s.now += self.rng.uniform(2.0, 25.0)

    def check_estimate(self, true: int, estimate: int) -> None:
        stats = self.stats
        under, over = true / estimate - 1, estimate / true - 1
        if not self.sc.mixed:
            stats.max_underestimate = max(stats.max_underestimate, under)
            stats.max_overestimate = max(stats.max_overestimate, over)
            return
        stats.mixed_calls += 1
        stats.mixed_underestimate = max(stats.mixed_underestimate, under)
        stats.mixed_overestimate = max(stats.mixed_overestimate, over)
        within = int(under <= 0.05 and over <= 0.05)
        stats.mixed_within_5pct += within
        if self.s.calibration.tokens_per_extra_byte is not None:
            stats.learnt_calls += 1
            stats.learnt_within_5pct += within

    # ----------------------------------------------------------------- compaction

    def summarise(self, plan: CompactionPlan) -> str | None:
        """A deterministic stand-in for the summariser, called piece by piece as
        the compactor does, every call checked against the summariser's window;
        it records coverage. None when no summary could be written."""
        zone = Zone.of(plan.to_compact, first_user_request(plan.snapshot))
        window = SummaryWindow.for_summaries(self.sc.summary_num_ctx, self.s.calibration)
        notes, start, pieces = plan.snapshot.summary, 0, 0
        while start < len(zone.entries):
            try:
                piece = next_piece(zone, start, notes, window)
            except NothingFits:
                return None
            self.check_summary_call(piece.messages, window)
            self.provider.summarise(piece.messages)
            if self.rng.random() < 0.05:  # cut off at its length limit: never kept
                self.stats.summaries_cut_off += 1
                roomier = window.with_more_room()
                if roomier is None:
                    return None
                window = roomier
                continue
            self.summaries += 1
            pieces += 1
            self.stats.entries_cut += piece.cut_chars > 0
            head = f"notes {self.summaries}: "
            notes = head + "n" * max(0, self.notes_length(plan) - len(head))
            start = piece.end
        assert notes is not None
        self.stats.summaries_in_pieces += pieces > 1
        earlier = self.s.covered.get(plan.snapshot.summary or "", frozenset())
        self.s.covered[notes] = earlier | {message_id(m) for m in plan.to_compact}
        return notes

    def check_summary_call(self, messages: list[dict[str, str]], window: SummaryWindow) -> None:
        if SUMMARY_MARKER not in messages[0]["content"]:
            raise self.fail("the summarisation request lacks its marker")
        true = self.provider.true_tokens(messages, tools=())
        if true > window.prompt_budget:
            raise self.fail(
                f"summary call of {true} true tokens over the summariser's budget "
                f"{window.prompt_budget} (num_ctx {window.num_ctx}, {window.output_tokens} "
                "kept for the summary)")
        self.stats.summary_calls += 1
        self.stats.max_summary_fill = max(self.stats.max_summary_fill,
                                          true / window.prompt_budget)

    def notes_length(self, plan: CompactionPlan) -> int:
        """Short notes, or (verbose) the earlier ones grown by part of the zone, up to
        the summariser's output budget (the window's reply room), never beyond."""
        if not self.sc.verbose_notes:
            return self.rng.randint(40, 160)
        most = int(0.9 * self.sc.headroom * self.sc.chars_per_token)
        earlier = len(plan.snapshot.summary or "")
        zone = sum(len(m.content) for m in plan.to_compact)
        return min(most, max(earlier, 40) + int(zone * self.rng.uniform(0.1, 0.5)))

    def apply_splice(self, plan: CompactionPlan, worth_checking: bool = False) -> bool:
        """Summarise and splice under the lock; False when the splice conflicts."""
        current = self.s.history
        summary = self.summarise(plan)
        if summary is None:
            return False
        try:
            snapshot = splice(current, plan, summary)
        except SpliceConflict:
            self.stats.conflicts += 1
            return False
        # Not in the mixed family: its estimates are not yet within the 5 % the
        # relief rule's slack assumes (recorded in the stats, not enforced).
        if worth_checking and not self.sc.mixed:
            self.check_relief(current, snapshot)
        since = current.messages[len(plan.snapshot.messages):]
        kept = {message_id(m) for m in snapshot.messages}
        if not {message_id(m) for m in (*plan.live, *since)} <= kept:
            raise self.fail("the live zone shrank during a compaction")
        self.s.history = Conversation(summary=snapshot.summary, messages=snapshot.messages,
                                      compactions=snapshot.compactions, just_compacted=True)
        self.stats.splices += 1
        self.check_history()
        return True

    def check_relief(self, before: Conversation, after: Snapshot) -> None:
        """A compaction the decider asked for frees about the minimum relief or more:
        rewriting the summary alone is not worth a model call."""
        spliced = Conversation(summary=after.summary, messages=after.messages)
        freed = (self.provider.true_tokens(render_messages(self.sc.system, before))
                 - self.provider.true_tokens(render_messages(self.sc.system, spliced)))
        needed = self.sc.policy.min_relief * self.sc.budget
        self.stats.least_relief = min(self.stats.least_relief, freed / needed)
        if freed < (1 - RELIEF_SLACK) * needed:
            raise self.fail(
                f"a decider's compaction freed {freed} true tokens, less than the minimum "
                f"relief of {needed:.0f} ({self.sc.policy.min_relief:.0%} of {self.sc.budget})"
            )

    def emergency_compaction(self) -> None:
        """The generator's last guard: compact now, keeping only the last turn raw."""
        plan = plan_compaction(self.s.history, tail_turns_for(Level.emergency, self.sc.tail_turns))
        if plan is None:
            return
        self.stats.emergency_compactions += 1
        # Shown as compacting only where the mode allows it beside the turn.
        flag = self.sc.mode is CompactionMode.background and not self.s.state.compacting
        if flag:
            self.act(Action.start_compaction)
        self.apply_splice(plan)
        if flag:
            self.act(Action.complete_compaction)

    def between_turns(self) -> None:
        """The lock is free: a due background splice or a queued blocking one runs."""
        flight = self.s.in_flight
        if flight is not None and flight.splice_before_turn <= self.turn:
            ok = self.apply_splice(flight.plan, flight.worth_checking)
            self.s.in_flight = None
            self.act(Action.complete_compaction)
            self.result(ok)
        if self.s.queued is not None:
            self.blocking_compaction(self.s.queued)

    def blocking_compaction(self, request: InFlight) -> None:
        self.s.queued = None
        self.act(Action.start_compaction)
        if self.rng.random() < 0.5:
            # A query arriving now is rejected and the session stays compacting.
            try:
                transition(self.s.state, Action.receive, self.sc.mode)
            except IllegalTransition:
                self.stats.rejected_queries += 1
            else:
                raise self.fail("blocking mode accepted a query while compacting")
        plan = plan_compaction(self.s.history, tail_turns_for(request.level, self.sc.tail_turns))
        # Planned afresh here: if the turn's own emergency compaction came first,
        # the decider's judgement was about another history.
        unchanged = self.s.history.compactions == request.plan.snapshot.compactions
        ok = plan is not None and self.apply_splice(plan, request.worth_checking and unchanged)
        self.act(Action.complete_compaction)
        self.result(ok)

    def result(self, ok: bool) -> None:
        """compaction.result reaches the decider."""
        tokens_after = None
        if ok:
            _, size = self.render(())
            tokens_after = estimate_size(size, self.s.calibration)
        self.s.memory = on_result(self.s.memory, tokens_after, self.s.now)
        self.s.completed_since_fire = True

    # ----------------------------------------------------------------- the decider

    def decider_step(self, next_pending: Sequence[ChatMessage]) -> None:
        sc, s = self.sc, self.s
        _, size = self.render(next_pending)
        estimate = estimate_size(size, s.calibration)
        level = level_for(estimate, sc.budget, sc.policy)
        # Sized as the generator's report and the decider size it: what the
        # compaction replaces, the summary included, and the summary apart.
        weights = HistoryWeights.of(sc.system, s.history)
        compactable = 0
        if level is not None:
            boundary = choose_boundary(s.history.messages, tail_turns_for(level, sc.tail_turns))
            compactable = part_tokens(size, weights.compactable(boundary), s.calibration)
        obs = Observation(estimate, sc.budget, compactable, s.now,
                          summary_tokens=part_tokens(size, weights.summary, s.calibration),
                          summary_allowance=summary_allowance(sc.num_ctx, s.calibration))
        decision, s.memory = decide(obs, s.memory, sc.policy)
        if not decision.fire:
            return
        assert decision.level is not None
        self.check_firing(decision.level, next_pending)
        self.start_background(decision.level)

    def check_firing(self, level: Level, next_pending: Sequence[ChatMessage]) -> None:
        s = self.s
        self.stats.decider_firings += 1
        if s.in_flight is not None or s.queued is not None:
            raise self.fail("two compactions pending for the session")
        consecutive = s.last_fire_turn is not None and self.turn - s.last_fire_turn <= 1
        escalated = level is Level.emergency and s.last_fire_level is not Level.emergency
        if consecutive and not s.completed_since_fire and not escalated:
            raise self.fail("the decider fired on consecutive turns without a compaction between")
        messages, _ = self.render(next_pending)
        true = self.provider.true_tokens(messages)
        self.check_not_premature(true, "decider", self.sc.policy.threshold, PREMATURE_SLACK)
        excess = self.excess(true, self.sc.policy.threshold)
        self.stats.decider_excess = min(self.stats.decider_excess, excess)
        s.last_fire_turn, s.last_fire_level, s.completed_since_fire = self.turn, level, False

    def check_not_premature(self, true_tokens: int, who: str, threshold: float,
                            slack: float) -> None:
        """Once calibrated, nothing compacts well below the line it acts on
        (dense text the provider has not counted yet is charged cautiously
        on purpose: it is the calibration that is not there yet)."""
        if not self.s.calibration.reports or self.sc.mixed:
            return
        floor = (threshold - slack) * self.sc.budget
        if true_tokens < floor:
            raise self.fail(
                f"{who} compaction fired at {true_tokens} true tokens, below {floor:.0f} "
                f"(line {threshold:.0%} - {slack:.0%} of {self.sc.budget})"
            )

    def excess(self, true_tokens: int, line: float) -> float:
        if not self.s.calibration.reports or self.sc.mixed:
            return math.inf
        return true_tokens / self.sc.budget - line

    def start_background(self, level: Level) -> None:
        s = self.s
        plan = plan_compaction(s.history, tail_turns_for(level, self.sc.tail_turns))
        if plan is None:
            # Only the summary lies before the live zone: such a request would be
            # skipped, and made again every cooldown for as long as that lasts.
            raise self.fail(f"the decider fired ({level.value}) with nothing raw to compact")
        checked = bool(s.calibration.reports)
        if self.sc.mode is CompactionMode.blocking:
            s.queued = InFlight(plan, level, self.turn + 1, checked)
            return
        self.act(Action.start_compaction)
        delay = self.rng.choice((0, 0, 1, 1, 2, 3))
        s.in_flight = InFlight(plan, level, self.turn + 1 + delay, checked)

    # ----------------------------------------------------------------- accounting

    def check_history(self) -> None:
        """No message lost or duplicated: raw or covered by the summary, never both."""
        history = self.s.history
        raw = [message_id(m) for m in history.messages]
        if len(raw) != len(set(raw)):
            raise self.fail("a message is duplicated in the raw history")
        covered = self.s.covered.get(history.summary or "", frozenset())
        if covered & set(raw):
            raise self.fail("a message is both summarised and raw")
        missing = self.s.appended - covered - set(raw)
        if missing:
            raise self.fail(f"messages lost: {sorted(missing)[:10]}")
        if (covered | set(raw)) - self.s.appended:
            raise self.fail("the history holds messages that were never appended")


def run_scenario(seed: int) -> Stats:
    return Simulation(seed).run()
