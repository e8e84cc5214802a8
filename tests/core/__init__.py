"""Core tests; shared hypothesis strategies for histories live here."""

from __future__ import annotations

from hypothesis import strategies as st

from schemas.history import ChatMessage, ToolCall

text = st.text(alphabet="abcxyz é\n{}\"", max_size=40)
tool_names = st.sampled_from(["read_file", "search", "run"])


@st.composite
def turns(draw: st.DrawFn) -> list[ChatMessage]:
    """One turn: a user message, optional tool rounds, an answer."""
    out = [ChatMessage(role="user", content=draw(text))]
    for _ in range(draw(st.integers(0, 2))):
        name = draw(tool_names)
        args = draw(st.dictionaries(st.sampled_from(["path", "q", "n"]), text, max_size=2))
        out.append(ChatMessage(role="assistant", tool_calls=(ToolCall(name=name, arguments=args),)))
        out.append(ChatMessage(role="tool", tool_name=name, content=draw(text)))
    out.append(ChatMessage(role="assistant", content=draw(text)))
    return out


@st.composite
def histories(draw: st.DrawFn, max_turns: int = 8) -> tuple[ChatMessage, ...]:
    """Whole turns, optionally after an unfinished leading fragment (no user message)."""
    lead: list[ChatMessage] = []
    if draw(st.booleans()):
        lead = [ChatMessage(role="assistant", content=draw(text))]
    body = [m for turn in draw(st.lists(turns(), max_size=max_turns)) for m in turn]
    return tuple(lead + body)
