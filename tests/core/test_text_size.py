from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.history import ChatMessage, Conversation
from services.core.context import next_prompt_size
from services.core.prompt import render_messages
from services.core.text_size import (
    MESSAGE_OVERHEAD_CHARS,
    HistoryWeights,
    history_weights,
    prompt_size,
)
from tests.core import histories
from tests.core.test_prompt import HISTORY, SYSTEM

SYSTEMS = st.text(max_size=30)
SUMMARIES = st.one_of(st.none(), st.text(max_size=30))
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {}}}]


def summarised(history: tuple[ChatMessage, ...], summary: str | None) -> Conversation:
    """The history after one compaction when there is a summary, else never compacted."""
    return Conversation(summary=summary, messages=history, compactions=int(summary is not None))


def history_chars(history: tuple[ChatMessage, ...]) -> int:
    return history_weights(history)[0][-1]


def test_a_prompt_weighs_its_content_tool_calls_tool_name_and_framing() -> None:
    msgs = render_messages(SYSTEM, Conversation(messages=HISTORY))
    calls_json = json.dumps(msgs[2]["tool_calls"], separators=(",", ":"), sort_keys=True)
    want = (
        len(SYSTEM) + len("read it") + len(calls_json) + len("127.0.0.1 localhost")
        + len("read_file") + len("done") + 5 * MESSAGE_OVERHEAD_CHARS
    )
    assert prompt_size(msgs).chars == want
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    tools_json = json.dumps(tools, separators=(",", ":"), sort_keys=True)
    assert prompt_size(msgs, tools).chars == want + len(tools_json)
    assert prompt_size([]).chars == 0


@settings(max_examples=60, deadline=None)
@given(histories(), SYSTEMS, SUMMARIES)
def test_chars_are_additive_over_messages(
    history: tuple[ChatMessage, ...], system: str, summary: str | None
) -> None:
    conv = summarised(history, summary)
    out = render_messages(system, conv)
    head = out[: len(out) - len(history)]
    assert prompt_size(out).chars == prompt_size(head).chars + history_chars(history)
    assert [m["role"] for m in out[len(head):]] == [m.role for m in history]
    if system:
        assert out[0] == {"role": "system", "content": system}


@settings(max_examples=60, deadline=None)
@given(histories())
def test_history_weights_weigh_every_prefix_of_the_history(
    history: tuple[ChatMessage, ...],
) -> None:
    running, _ = history_weights(history)
    assert running == [history_chars(history[:i]) for i in range(len(history) + 1)]


@settings(max_examples=60, deadline=None)
@given(histories(), SYSTEMS, SUMMARIES)
def test_history_weights_match_the_rendered_prompt(
    history: tuple[ChatMessage, ...], system: str, summary: str | None
) -> None:
    conv = summarised(history, summary)
    weights = HistoryWeights.of(system, conv)
    prompt = render_messages(system, conv)
    assert weights.next_prompt == prompt_size(prompt).chars
    assert weights.next_prompt_messages == len(prompt)
    for tools in ([], TOOLS):  # the whole size, as weighing the prompt rendered anew
        assert weights.next_prompt_size(tools) == next_prompt_size(system, conv, tools)
    for boundary in range(len(history) + 1):
        before = Conversation(summary=summary, messages=history[:boundary])
        assert weights.compactable(boundary) == prompt_size(render_messages("", before)).chars

