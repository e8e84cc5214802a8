"""Row splice_128k: the pure work a compaction does once its summary is written
(plan, splice, render, serialise the rollup) on a history of about 128k tokens,
in-process, so its cost can be read apart from any I/O."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from schemas.history import ChatMessage, Conversation, HistoryEntry, ToolCall
from scripts.benchmarks.harness import Row
from scripts.benchmarks.measure import summary_ms
from scripts.ollama_stub import filler_text
from services.core.prompt import render_messages
from services.core.splice import plan_compaction, splice
from services.core.text_size import history_weights, prompt_size

if TYPE_CHECKING:
    from scripts.benchmarks.rows import Bench

# Turns answered while the splice's summary was written (they must all be kept).
MEANWHILE_TURNS = 3


def big_history(messages: int, target_chars: int) -> Conversation:
    """`messages` messages of about `target_chars` characters as sent: turns of user +
    assistant, every other one with a tool call and its result in between."""

    def build(scale: float) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        turn = 0
        while len(out) < messages:
            out.append(ChatMessage(role="user", content=f"request {turn}: "
                                   + filler_text(round(450 * scale), turn)))
            if turn % 2 == 0 and len(out) + 3 <= messages:
                call = ToolCall(name="read_file", arguments={"path": f"src/module_{turn}.py"})
                out.append(ChatMessage(role="assistant", content="Let me look at the file.",
                                       tool_calls=(call,)))
                out.append(ChatMessage(role="tool", tool_name="read_file",
                                       content=filler_text(round(2800 * scale), turn + 1)))
            if len(out) < messages:
                out.append(ChatMessage(role="assistant", content=f"answer {turn}: "
                                       + filler_text(round(1950 * scale), turn + 2)))
            turn += 1
        return out

    first = build(1.0)
    scaled = build(target_chars / history_weights(first)[0][-1])
    return Conversation(messages=tuple(scaled))


def as_read_back(conversation: Conversation, extra_turns: int) -> Conversation:
    """The history as the splice finds it: read back from the store (equal, not the same
    objects) with the turns answered while the summary was being written."""
    copy = Conversation.model_validate_json(conversation.model_dump_json())
    for index in range(extra_turns):
        copy = copy.apply(HistoryEntry.of_turn((
            ChatMessage(role="user", content=f"meanwhile {index}"),
            ChatMessage(role="assistant", content=f"Echo: meanwhile {index}"))))
    return copy


def splice_once(snapshot: Conversation, current: Conversation, system: str, summary: str,
                tail_turns: int) -> tuple[float, float, int, int]:
    """(splice seconds, serialise seconds, rollup JSON bytes, chars sent after)."""
    started = time.perf_counter()
    plan = plan_compaction(snapshot, tail_turns)
    if plan is None:
        raise RuntimeError("nothing to compact in the benchmark history")
    rollup = splice(current, plan, summary)
    after = Conversation(summary=rollup.summary, messages=rollup.messages,
                         compactions=rollup.compactions)
    chars = prompt_size(render_messages(system, after)).chars
    spliced = time.perf_counter()
    data = HistoryEntry.of_snapshot(rollup).model_dump_json().encode()
    serialised = time.perf_counter()
    return spliced - started, serialised - spliced, len(data), chars


def timed_splices(conversation: Conversation, system: str, summary: str, tail: int,
                  reps: int) -> tuple[list[float], list[float], int, int]:
    """`splice_once` `reps` times on the history as read back: (splice seconds,
    serialise seconds, rollup JSON bytes, chars sent after)."""
    splice_s: list[float] = []
    serialise_s: list[float] = []
    rollup_bytes = chars_after = 0
    current = as_read_back(conversation, MEANWHILE_TURNS)
    for _ in range(reps):
        one, two, rollup_bytes, chars_after = splice_once(conversation, current, system,
                                                          summary, tail)
        splice_s.append(one)
        serialise_s.append(two)
    return splice_s, serialise_s, rollup_bytes, chars_after


def whole_history_work(conversation: Conversation, system: str, reps: int
                       ) -> tuple[list[float], int, float]:
    """(render seconds, JSON bytes, serialise seconds) of the whole history."""
    # For contrast: the pure work on the whole 128k history that a compaction
    # also does (its token estimate before), and a rollup that kept everything.
    render_full_s: list[float] = []
    for _ in range(reps):
        started = time.perf_counter()
        prompt_size(render_messages(system, conversation))
        render_full_s.append(time.perf_counter() - started)
    started = time.perf_counter()
    whole = HistoryEntry.of_turn(conversation.messages).model_dump_json().encode()
    whole_s = time.perf_counter() - started
    return render_full_s, len(whole), whole_s


def row_splice(bench: Bench) -> Row:
    params = bench.params
    conversation = big_history(params.splice_messages, params.splice_chars)
    system = "You are a careful coding assistant. " * 10
    summary = "Goal: refactor the parser.\n" + filler_text(3900, 3)
    tail = 4  # the generator's default COMPACTION_TAIL_TURNS
    splice_s, serialise_s, rollup_bytes, chars_after = timed_splices(
        conversation, system, summary, tail, params.splice_reps)
    render_full_s, whole_bytes, whole_s = whole_history_work(conversation, system,
                                                             params.splice_reps)
    chars_before = prompt_size(render_messages(system, conversation)).chars
    splice_stats = summary_ms(splice_s)
    serialise_stats = summary_ms(serialise_s)
    return Row(
        name="splice_128k", value=splice_stats["p50_ms"], unit="ms (p50)", target=None,
        detail=f"plan+splice+render {splice_stats['p50_ms']:.2f} ms p50 "
               f"({len(conversation.messages)} msgs, {chars_before:,} chars ≈ "
               f"{chars_before // 4:,} tokens); rollup JSON {serialise_stats['p50_ms']:.3f} ms, "
               f"{rollup_bytes:,} B",
        raw={
            "splice": splice_stats,
            "serialise_rollup": serialise_stats,
            "rollup_json_bytes": rollup_bytes,
            "render_full_history": summary_ms(render_full_s),
            "whole_history_json_bytes": whole_bytes,
            "whole_history_serialise_ms": whole_s * 1000,
            "messages": len(conversation.messages),
            "tool_results": sum(1 for m in conversation.messages if m.role == "tool"),
            "history_chars_sent": chars_before,
            "approx_tokens_at_4_cpt": chars_before // 4,
            "chars_sent_after": chars_after,
            "tail_turns": tail,
            "turns_appended_during_summary": MEANWHILE_TURNS,
            "summary_chars": len(summary),
            "repetitions": params.splice_reps,
        },
    )
