"""Row turn_weighing: the size bookkeeping every turn does on its whole prompt
(does it fit, what was sent, what a prompt cache held, what the next prompt
weighs, what each prefix weighs), in-process, on an 800-message history:
the pure work that grows with a session's length. A profile of long
sessions found it the generator's largest cost of its own."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from schemas.history import ChatMessage, Conversation
from scripts.benchmarks.harness import Row
from scripts.benchmarks.measure import summary_ms
from services.core.context import next_prompt_size
from services.core.prompt import HistoryWeights, render_messages
from services.core.prompt_cache import cached_size
from services.core.text_size import prompt_size
from services.core.tokens import Calibration, estimate_prompt

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


def one_turns_weighing(conversation: Conversation) -> None:
    """What a turn of the generator weighs, in the order it does."""
    prompt = render_messages(SYSTEM, conversation)
    estimate_prompt(prompt, Calibration(0.25, 1))
    sent = prompt_size(prompt)
    cached_size(prompt[:-2], prompt, whole=sent)
    HistoryWeights.of(SYSTEM, conversation)
    next_prompt_size(SYSTEM, conversation, ())


def row_turn_weighing(bench: Bench) -> Row:
    conversation = long_history(WEIGHED_MESSAGES)
    times = []
    for _ in range(bench.params.splice_reps * 4):
        started = time.perf_counter()
        one_turns_weighing(conversation)
        times.append(time.perf_counter() - started)
    stats = summary_ms(times)
    return Row(
        name="turn_weighing", value=stats["p50_ms"], unit="ms (p50)", target=None,
        detail=f"a turn's size bookkeeping on a {WEIGHED_MESSAGES}-message history "
               f"(render, fit, sent, cached part, weights, next prompt): "
               f"p50 {stats['p50_ms']:.2f} ms, p99 {stats['p99_ms']:.2f} ms",
        raw={"messages": WEIGHED_MESSAGES, "times": stats, "repetitions": len(times)},
    )
