"""The tools service's tools, and the service answering over real NATS."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.service import Service

from schemas import subjects
from schemas.history import ToolCall
from schemas.messages import ToolDefinitions, ToolInvocation, ToolListRequest, ToolOutcome
from services.generator.toolbox import Toolbox
from services.shared.bus import CORRELATION_HEADER, SESSION_HEADER, Bus, decode, round_trip
from services.tools.catalogue import (
    TOOLS,
    Tool,
    ToolFailure,
    calculate,
    current_time,
    word_count,
)
from services.tools.service import ToolsService, run_tool
from tests.processes import ServiceProcess


@pytest.mark.parametrize("expression, value", [
    ("6*7", "42"), ("(3 + 4) * 2", "14"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-2 ** 2", "-4"),
    ("2 ** 10", "1024"), ("10 % 4", "2"), ("1.5 + 1", "2.5"), ("1 ** 1000", "1"),
    ("(2 ** 1000) * 2", str(2 ** 1001)), ("0 ** 1000", "0"),
])
def test_calculate_does_arithmetic(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os')", "open('x')", "a + 1", "[1, 2]", "2 ** 100000", "1 / 0", "1 +", "x" * 300,
    "'a' * 3", "((9**999)**999)**999", "(9**999)*(9**999)*(9**999)*(9**999)*(9**999)",
    "10.0 ** 999",
])
def test_calculate_refuses_anything_but_arithmetic(expression: str) -> None:
    with pytest.raises(ToolFailure):
        calculate(expression)


def test_word_count_and_time() -> None:
    assert word_count("one two\nthree") == "3 words, 2 lines, 13 characters"
    assert current_time("UTC").endswith("+00:00")
    with pytest.raises(ToolFailure, match="unknown time zone"):
        current_time("Mars/Olympus")


def test_failures_become_error_outcomes_not_exceptions() -> None:
    assert run_tool(TOOLS["calculate"], {"expression": "1/0"}).error == "division by zero"
    assert run_tool(TOOLS["word_count"], {}).error.startswith("bad arguments")
    counted = run_tool(TOOLS["word_count"], {"text": "a b"})
    assert counted.content == "2 words, 1 lines, 3 characters"


@pytest.fixture
async def tools_nc(nats_url: str) -> AsyncIterator[NATS]:
    """The real tools process, and a client to call it."""
    service = ServiceProcess("services.tools", {"NATS_URL": nats_url}).start()
    nc = await nats.connect(nats_url)
    yield nc
    await nc.drain()
    assert service.stop() == 0


async def test_the_service_lists_and_runs_its_tools_over_nats(tools_nc: NATS) -> None:
    bus = Bus(tools_nc, "generator")
    asked = await bus.request(subjects.TOOL_LIST, ToolListRequest(), timeout_s=10)
    listing = decode(asked.data, ToolDefinitions, subjects.TOOL_LIST).payload.tools
    assert {d["function"]["name"] for d in listing} >= {"calculate", "word_count",
                                                        "current_time"}
    subject = subjects.tool("calculate")
    env = bus.envelope(subject, ToolInvocation(name="calculate",
                                               arguments={"expression": "2+2"}))
    reply = await tools_nc.request(subject, env.model_dump_json().encode(), timeout=10)
    assert decode(reply.data, ToolOutcome, subject).payload.content == "4"
    reported = await tools_nc.subscribe(subjects.ERROR_SUBJECT)
    for asking in (subject, subjects.TOOL_LIST):
        bad = await tools_nc.request(asking, b"{broken", timeout=10)
        assert json.loads(bad.data)["payload"]["code"] == "invalid_message"
        report = json.loads((await reported.next_msg(timeout=10)).data)
        assert report["payload"]["subject"] == asking  # told on system.error too, as elsewhere


async def test_a_tool_call_and_its_answer_carry_the_tracing_headers(tools_nc: NATS) -> None:
    """Both went without the correlation, session and traceparent headers
    every other message carries."""
    seen: list[Msg] = []

    async def heard(msg: Msg) -> None:
        seen.append(msg)

    watcher = await tools_nc.subscribe(subjects.tool("word_count"), cb=heard)
    await round_trip(tools_nc)
    cid = "4bf92f3577b34da6a3ce929d0e0e4736"
    toolbox = Toolbox(Bus(tools_nc, "generator"), timeout_s=30)
    run = await toolbox.run(ToolCall(name="word_count", arguments={"text": "a b"}),
                            "query", cid, "traced")
    assert run.message.content.startswith("2 words")
    await watcher.unsubscribe()
    asked = seen[0].headers or {}
    assert asked[CORRELATION_HEADER] == cid and asked[SESSION_HEADER] == "traced"
    assert cid in asked["traceparent"]
    bus = Bus(tools_nc, "generator")
    env = bus.envelope(subjects.tool("word_count"), ToolInvocation(
        name="word_count", arguments={"text": "a"}), correlation_id=cid, session_id="traced")
    answer = await tools_nc.request(subjects.tool("word_count"),
                                    env.model_dump_json().encode(), timeout=30)
    assert (answer.headers or {}).get(CORRELATION_HEADER) == cid
    assert (answer.headers or {}).get(SESSION_HEADER) == "traced"


async def serving(nc: NATS, tools: dict[str, Tool]) -> tuple[ToolsService, Service]:
    """A tools service with these tools, its endpoints registered as the
    runner registers them."""
    service = ToolsService(Bus(nc, "tools"), tools)
    micro = await add_service(nc, name="tools-under-test", version="0.0.0")
    for endpoint in service.endpoints():
        await micro.add_endpoint(name=endpoint.name, subject=endpoint.subject,
                                 handler=endpoint.handler)
    return service, micro


async def test_a_slow_call_holds_up_no_other_call_of_the_same_tool(nc: NATS) -> None:
    """nats-py hands an endpoint its next request only once its handler
    returns: a slow recall held every other session's recall behind it, up
    to their timeouts. A stop still answers the call under way."""
    entered, gate = threading.Event(), threading.Event()

    def wait(hold: bool = False) -> str:
        if hold:
            entered.set()
            gate.wait(30)
        return "held" if hold else "quick"

    tools = {"wait": Tool("wait", "waits when asked", {"type": "object"}, wait)}
    service, micro = await serving(nc, tools)
    asker = Bus(nc, "generator")

    async def call(arguments: dict[str, bool]) -> str:
        msg = await asker.request(subjects.tool("wait"), ToolInvocation(
            name="wait", arguments=arguments), timeout_s=10)
        return str(decode(msg.data, ToolOutcome, subjects.tool("wait")).payload.content)

    held = asyncio.create_task(call({"hold": True}))
    try:
        assert await asyncio.to_thread(entered.wait, 10)  # the slow call is under way
        assert await call({}) == "quick"
        stopping = asyncio.create_task(service.stop())
        gate.set()
        assert await held == "held"
        await stopping
    finally:
        gate.set()
        await micro.stop()


async def test_a_stop_answers_the_calls_that_come_while_it_waits(nc: NATS) -> None:
    """The endpoints take calls until the stop is over: one that came while
    it waited for an earlier call is answered too, not left to its caller's
    timeout."""
    entered = {name: threading.Event() for name in ("first", "second")}
    gates = {name: threading.Event() for name in ("first", "second")}

    def wait(name: str) -> str:
        entered[name].set()
        gates[name].wait(30)
        return name

    tools = {"wait": Tool("wait", "waits until let go", {"type": "object"}, wait)}
    service, micro = await serving(nc, tools)
    asker = Bus(nc, "generator")

    async def call(name: str) -> str:
        msg = await asker.request(subjects.tool("wait"), ToolInvocation(
            name="wait", arguments={"name": name}), timeout_s=10)
        return str(decode(msg.data, ToolOutcome, subjects.tool("wait")).payload.content)

    try:
        first = asyncio.create_task(call("first"))
        assert await asyncio.to_thread(entered["first"].wait, 10)
        stopping = asyncio.create_task(service.stop())
        second = asyncio.create_task(call("second"))
        assert await asyncio.to_thread(entered["second"].wait, 10)
        gates["first"].set()
        assert await first == "first"
        assert not stopping.done()  # the second call is still being answered
        gates["second"].set()
        assert await second == "second"
        await stopping
    finally:
        for gate in gates.values():
            gate.set()
        await micro.stop()


@pytest.mark.parametrize("expression, error", [
    ("(-8) ** (1/3)", "not a real number"), ("((-8) ** 0.5) // 1", "not a real number"),
    ("(-1) ** 0.5 * 0", "not a real number"), ("1e308 * 10", "result too large"),
    ("1e308 * 10 - 1e308 * 10", "result too large"), ("1e999", "result too large"),
    ("1 / (1e308 * 10)", "result too large"),
])
def test_calculate_refuses_answers_that_are_not_finite_real_numbers(
        expression: str, error: str) -> None:
    """Float arithmetic overflows to inf and nan without raising, and a
    fractional power of a negative number is complex: none is an answer."""
    assert run_tool(TOOLS["calculate"], {"expression": expression}).error == error


def test_calculate_claims_no_exactness_that_floats_lack() -> None:
    assert calculate("0.1 + 0.2") != "0.3"
    description = TOOLS["calculate"].description
    assert "exactly" not in description and "floating point" in description


def test_text_that_is_not_a_string_is_a_bad_argument_not_a_tool_error() -> None:
    assert run_tool(TOOLS["word_count"], {"text": 42}).error == (
        "bad arguments: text must be a string, not int")
    with pytest.raises(ToolFailure, match="bad arguments"):
        word_count(["a", "b"])  # type: ignore[arg-type]


def test_word_count_counts_lines_as_an_editor_does() -> None:
    """Only \\n, \\r\\n and \\r end a line; \\v, \\x1c and U+2028 do not."""
    lines = {text: word_count(text).split(", ")[1] for text in (
        "a\u000bb\u001cc\u2028d", "a\r\nb\rc\nd", "a\n", "", "a\n\nb", "a\fb\x85c")}
    assert lines == {"a\u000bb\u001cc\u2028d": "1 lines", "a\r\nb\rc\nd": "4 lines",
                     "a\n": "1 lines", "": "0 lines", "a\n\nb": "3 lines",
                     "a\fb\x85c": "1 lines"}
