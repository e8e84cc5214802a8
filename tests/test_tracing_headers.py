"""The tracing headers every published message carries: the correlation id
as the W3C trace id when it can be one, and never a malformed traceparent."""

from __future__ import annotations

import re

import pytest

from schemas.envelope import Envelope, new_id
from schemas.messages import StateChange
from services.shared.bus import headers_for, traceparent

TRACE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


def test_a_hex_correlation_id_is_the_trace_id_with_a_fresh_span_each_time() -> None:
    cid = "0123456789abcdef" * 2
    first, second = traceparent(cid), traceparent(cid)
    assert first and second
    parsed = [TRACE.fullmatch(t) for t in (first, second)]
    assert all(parsed) and {m[1] for m in parsed if m} == {cid}
    assert first != second  # the span ids differ
    assert all(m[2] != "0" * 16 for m in parsed if m)  # an all-zero span id is invalid


def test_every_new_id_is_a_distinct_trace_id() -> None:
    """32 hex digits however many leading zeros the number has, so that every
    correlation id the product makes can be a trace id."""
    ids = [new_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    assert all(traceparent(i) for i in ids[:100])


@pytest.mark.parametrize("cid", [
    "0123456789ABCDEF" * 2,          # upper case: not a W3C trace id
    "0123456789abcdef" * 2 + "0",    # too long
    "0123456789abcdef",              # too short
    "0123456789abcdef" * 2 + "\n",   # a trailing newline
    "0123456789abcdeg" * 2,          # not hex
    "",
])
def test_an_id_that_cannot_be_a_trace_id_gets_no_traceparent(cid: str) -> None:
    assert traceparent(cid) is None


def test_headers_name_the_correlation_the_session_and_for_a_stream_the_message() -> None:
    env = Envelope[StateChange](
        message_id="m1", message_type="generator.state", subject="generator.state.s1",
        sender_id="generator-1", correlation_id="c" * 32, session_id="s1",
        payload=StateChange(session_id="s1", from_state="idle", to_state="receiving",
                            action="receive", generator_id="generator-1"))
    plain, stored = headers_for(env), headers_for(env, stored_once=True)
    assert plain["Correlation-Id"] == "c" * 32 and plain["Session-Id"] == "s1"
    assert TRACE.fullmatch(plain["traceparent"])
    assert "Nats-Msg-Id" not in plain and stored["Nats-Msg-Id"] == "m1"
