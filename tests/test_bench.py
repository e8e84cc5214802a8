"""Smoke test of scripts/bench.py: the rows that need no process run in-process and
land in the JSON as numbers, and the pieces the other rows start (an echo
responder of its own, the bare turn of scripts/bare_turn.py) answer. Nothing
here asserts a timing: speed is measured by the benchmark itself, not by tests."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest

from schemas.envelope import enveloped
from schemas.messages import Payload, Query, Reply, StateChange
from scripts.bench import main
from scripts.benchmarks.against import against_row
from scripts.benchmarks.client import Answer, Http
from scripts.benchmarks.messages import kind_of
from scripts.benchmarks.round_trips import (
    Side,
    interleaved_turns,
    measure_nats_rtt,
    measure_nats_rtt_between_processes,
    running_bare_turn,
)
from scripts.benchmarks.rows import ROW_FUNCTIONS, ROWS, RUN_ORDER, params_for
from scripts.benchmarks.soak import faults_of, turn_text
from scripts.benchmarks.timeline import Watcher, joined, step_summary
from tests.events import eventually


def test_pure_rows_write_numeric_results(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = main(["--quick", "--in-process", "--rows", "splice_128k,estimate_error",
                 "--json", str(out)])
    assert code == 0
    document = json.loads(out.read_text())
    assert document["quick"] is True
    assert document["machine"]["cpu_count"] >= 1
    assert document["machine"]["python"]
    assert document["timestamp"]

    rows = {row["name"]: row for row in document["rows"]}
    assert set(rows) == {"splice_128k", "estimate_error"}
    for row in rows.values():
        assert row["error"] is None and row["skipped"] is None
        assert isinstance(row["value"], int | float) and math.isfinite(row["value"])
        assert row["unit"]
        assert row["meets_target"] in (True, False, None)

    splice = rows["splice_128k"]["raw"]
    assert splice["messages"] == 400
    assert splice["history_chars_sent"] > 400_000
    assert splice["rollup_json_bytes"] > 0
    assert splice["splice"]["n"] > 0

    estimate = rows["estimate_error"]
    assert estimate["target"] == {"op": "<=", "value": 5.0}
    assert estimate["raw"]["mode"].startswith("in-process")
    by_cpt = estimate["raw"]["max_abs_error_pct_by_cpt"]
    assert set(by_cpt) == {"2.5", "3.0", "4.0", "5.0", "6.0", "8.0"}
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in by_cpt.values())


def test_rows_that_need_processes_are_skipped_in_process(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--quick", "--in-process", "--rows", "nats_rtt", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["name"] == "nats_rtt"
    assert row["value"] is None and row["skipped"]


def test_turn_against_is_skipped_without_another_checkout(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["--quick", "--rows", "turn_against", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["value"] is None and "--against" in row["skipped"]


def test_turn_against_reads_this_checkouts_turns_against_the_others() -> None:
    async def not_asked(*_: str) -> Any:
        raise AssertionError("only the figures are read")

    def side(name: str, seconds: list[float], cpu_s: float) -> Side:
        timed = Side(name, not_asked, not_asked, frozenset())
        timed.samples, timed.cpu, timed.wall_s = seconds, {"generator:1": cpu_s}, 1.0
        return timed

    row = against_row(side("this", [0.004] * 9 + [0.1], 0.09),
                      side("that", [0.005] * 9 + [0.1], 0.06), "../before")
    assert row.value == pytest.approx(0.8)
    assert row.unit == "× before's turn (p50)"
    assert row.raw["cpu_ratio"] == pytest.approx(1.5)
    assert "10 turns each" in row.detail


async def test_round_trips_are_timed_within_a_process_and_between_two(nats_url: str) -> None:
    """Both responders answer: the one on a second connection here, and the one
    the benchmark starts as a process of its own (the script run as the responder)."""
    same = await measure_nats_rtt(nats_url, requests=20, warmup=2)
    between = await measure_nats_rtt_between_processes(nats_url, requests=20, warmup=2)
    assert len(same) == len(between) == 20
    assert all(sample > 0 for sample in same + between)


async def test_the_bare_turn_answers_each_query_of_a_session_in_turn() -> None:
    """The floor of the turn_floor row answers like the product: one reply per
    query, a session's queries one after the other."""
    with running_bare_turn() as (_, _, base_url):
        async with Http(base_url, 2) as http:
            replies = [await http.post(f"/q/{sid}", json={"content": f"q{n}"})
                       for sid in ("a", "b") for n in range(3)]
    assert [r.status_code for r in replies] == [200] * 6
    assert [json.loads(r.text)["reply"] for r in replies] == [
        f"Echo: q{n} (turn {n + 1})" for _ in ("a", "b") for n in range(3)]


async def test_the_contract_floor_sends_every_message_the_contract_asks_of_a_turn() -> None:
    """The floor of row turn_contract_floor: four state changes a turn (the
    latest of each session kept), every query acknowledged, and each report
    read by the process standing for the decider."""
    with running_bare_turn(contract=True) as (nats_url, _, base_url):
        async with Http(base_url, 2) as http:
            replies = [await http.post(f"/q/{sid}", json={"content": f"q{n}"})
                       for sid in ("a", "b") for n in range(3)]
        assert [r.status_code for r in replies] == [200] * 6
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            states = await js.stream_info("BARE_STATES")
            assert (states.state.last_seq, states.state.messages) == (24, 2)
            latest = await js.get_last_msg("BARE_STATES", "bare.s.b")
            assert json.loads(latest.data or b"") == {"session_id": "b", "state": "idle"}
            assert (await js.stream_info("BARE_QUERIES")).state.messages == 0
            async def all_read() -> bool:  # read as it lingers
                decider = await js.consumer_info("BARE_REPORTS", "bare_decider")
                return decider.delivered.stream_seq == 6 and decider.num_pending == 0

            await eventually(all_read, "the decider read the six reports")
        finally:
            await nc.close()


def test_every_row_is_listed_run_and_measured_by_a_function() -> None:
    """A row missing from one of the three lists is silently never run (or never shown)."""
    assert len(ROWS) == len(set(ROWS)) == len(RUN_ORDER)
    assert set(ROWS) == set(RUN_ORDER) == set(ROW_FUNCTIONS)
    assert "memory_sessions" in ROWS


def test_the_soak_counts_turns_lost_and_turns_twice_in_a_transcript() -> None:
    def said(role: str, content: str) -> dict[str, str]:
        return {"kind": "message", "role": role, "content": content}

    first, second, third = (turn_text(7, turn) for turn in range(3))
    marker = {"kind": "compaction", "summary": first}  # a summary is not a turn
    items = [said("user", first), said("assistant", "a"), marker, said("user", second),
             said("assistant", "b"), said("user", second), said("assistant", "b")]
    assert faults_of(items, 7, 3) == {"lost": 1, "duplicated": 1}
    assert faults_of(items[:2], 7, 1) == {"lost": 0, "duplicated": 0}
    assert faults_of([*items[:2], said("assistant", "again")], 7, 1)["duplicated"] == 1
    assert third not in str(items)


async def test_the_product_and_the_floor_take_turns_session_by_session() -> None:
    """turn_overhead and turn_floor are timed in alternating sessions, the order
    swapped every round, so that a slow spell of the machine falls on both."""
    log: list[tuple[str, str, str]] = []

    def side(name: str) -> Side:
        sessions = iter(f"{name}{n}" for n in range(100))

        async def new_session() -> str:
            return next(sessions)

        async def ask_one(sid: str, content: str) -> Answer:
            log.append((name, sid, content))
            return Answer(200, "{}")

        return Side(name, new_session, ask_one, frozenset())

    params = replace(params_for(quick=True), overhead_warmup=2, overhead_turns=6,
                     turns_per_session=2)
    product, floor = side("p"), side("f")
    await interleaved_turns(params, product, floor)
    sessions = [sid for _, sid, _ in log[::2]]
    assert sessions == ["p0", "f0", "p1", "f1", "f2", "p2", "p3", "f3"]
    assert len(product.samples) == len(floor.samples) == 6
    assert all(content.startswith("benchmark question ") for _, _, content in log)

    # With three, each round starts one further along.
    log.clear()
    product, floor, contract = side("p"), side("f"), side("c")
    await interleaved_turns(params, product, floor, contract)
    sessions = [sid for _, sid, _ in log[::2]]
    assert sessions == ["p0", "f0", "c0", "p1", "f1", "c1", "f2", "c2", "p2", "c3", "p3", "f3"]


def test_turn_messages_counts_subjects_by_kind() -> None:
    assert kind_of("history.s1") == "history.<sid>"
    assert kind_of("chat.reply.s1") == "chat.reply.<sid>"
    assert kind_of("generator.state.s-2") == "generator.state.<sid>"
    assert kind_of("_INBOX_generator.abc.7") == "_INBOX.*"
    assert kind_of("$JS.ACK.QUERIES.generator.1.5.5.0.0") == "$JS.ACK.*"
    assert kind_of("$JS.API.CONSUMER.MSG.NEXT.QUERIES.generator") == "$JS.API.CONSUMER.MSG.*"
    assert kind_of("$KV.session_locks.s1") == "$KV.session_locks.<key>"
    assert kind_of("response.generation") == "response.generation"


def test_turn_timeline_reads_each_turns_steps_off_the_envelopes() -> None:
    """The marks come from the envelopes' own timestamps, by correlation id,
    and line up with the driver's turns in the order their queries were made."""
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def envelope(payload: Payload, correlation_id: str, ms: float) -> bytes:
        return enveloped(type(payload))(
            message_type=payload.MESSAGE_TYPE, subject="s", sender_id="gateway",
            correlation_id=correlation_id, timestamp=start + timedelta(milliseconds=ms),
            payload=payload,
        ).model_dump_json().encode()

    def state(to_state: str) -> StateChange:
        return StateChange(session_id="s1", from_state="idle", to_state=to_state,
                           action="receive", generator_id="generator-1")

    watcher = Watcher()
    for correlation_id, at in (("second", 100.0), ("first", 0.0)):
        watcher.take(envelope(Query(session_id="s1", content="q"), correlation_id, at + 1))
        for step, to_state in enumerate(("receiving", "generating", "publishing", "idle")):
            watcher.take(envelope(state(to_state), correlation_id, at + 2 + step))
        watcher.take(envelope(Reply(session_id="s1", query_id="q", reply="a"),
                              correlation_id, at + 7))
    sent = start.timestamp()
    driver = [{"sent": sent, "answered": sent + 0.008},
              {"sent": sent + 0.1, "answered": sent + 0.109}]

    turns = joined(driver, watcher.marks)
    steps = step_summary(turns)
    assert [round(t["query"] - t["sent"], 6) for t in turns] == [0.001, 0.001]
    assert {step: round(s["p50_ms"], 3) for step, s in steps.items()} == {
        "intake": 1.0, "to_lock": 1.0, "under_lock": 1.0, "model": 1.0, "storing": 1.0,
        "replying": 2.0, "to_caller": 1.5}
    with pytest.raises(RuntimeError, match="saw 2 queries on the bus for 1 turns"):
        joined(driver[:1], watcher.marks)
