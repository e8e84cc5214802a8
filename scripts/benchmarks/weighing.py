"""Row turn_weighing: the size bookkeeping every turn does on its whole prompt
(what it weighs and so whether it fits, what a prompt cache held, what the
next prompt weighs, what each prefix weighs), in-process, on an 800-message history:
the pure work that grows with a session's length. A profile of long
sessions found it the generator's largest cost of its own."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from schemas.history import ChatMessage, Conversation
from scripts.benchmarks.harness import Row
from scripts.benchmarks.measure import summary_ms
from services.core.prompt import render_messages
from services.core.prompt_cache import cached_size, previous_call
from services.core.text_size import HistoryWeights
from services.core.tokens import Calibration, estimate_size
from services.generator.turn import WeighedPrompt

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

WEIGHED_MESSAGES = 800
SYSTEM = "You are a patient gardening assistant."


def long_history(messages: int) -> Conversation:
    out = []
    for turn in range(messages // 2):
        out.append(ChatMessage(role="user", content=f"question {turn} about the beds " * 3))
        out.append(ChatMessage(role="assistant", content=f"answer {turn}, in some detail " * 6))
    return Conversation(messages=out)


def before_the_call(conversation: Conversation) -> WeighedPrompt:
    """What a turn weighs before its model call: the prompt, once, and from
    its size whether it fits (and the answer's room)."""
    prompt = WeighedPrompt.of(render_messages(SYSTEM, conversation), [])
    estimate_size(prompt.size, Calibration(0.25, 1))
    return prompt


def after_the_reply(conversation: Conversation, prompt: WeighedPrompt) -> None:
    """What it weighs for the report, once the caller has its answer: what a
    prompt cache held of the call before, the history's weights and from
    them the next prompt."""
    cached_size(previous_call(SYSTEM, conversation, True), prompt.messages, whole=prompt.size)
    HistoryWeights.of(SYSTEM, conversation).next_prompt_size()


def row_turn_weighing(bench: Bench) -> Row:
    conversation = long_history(WEIGHED_MESSAGES)
    before, after = [], []
    for _ in range(bench.params.splice_reps * 4):
        started = time.perf_counter()
        prompt = before_the_call(conversation)
        called = time.perf_counter()
        after_the_reply(conversation, prompt)
        before.append(called - started)
        after.append(time.perf_counter() - called)
    whole = [b + a for b, a in zip(before, after, strict=True)]
    stats, first, last = summary_ms(whole), summary_ms(before), summary_ms(after)
    return Row(
        name="turn_weighing", value=stats["p50_ms"], unit="ms (p50)", target=None,
        detail=f"a turn's size bookkeeping on a {WEIGHED_MESSAGES}-message history: "
               f"p50 {stats['p50_ms']:.2f} ms, p99 {stats['p99_ms']:.2f} ms; of it before "
               f"the model call (render, fit) {first['p50_ms']:.2f} ms, after the reply "
               f"(cached part, weights, next prompt) {last['p50_ms']:.2f} ms",
        raw={"messages": WEIGHED_MESSAGES, "times": stats, "before_the_call": first,
             "after_the_reply": last, "repetitions": len(whole)},
    )
