"""Which payload travels on which subject, and JSON Schema for each of them."""

from __future__ import annotations

from typing import Any

from schemas import messages as m
from schemas import subjects as s
from schemas.envelope import Envelope
from schemas.history import HistoryEntry

# Subject (or prefix of per-session subjects) -> payload model.
BY_SUBJECT: dict[str, type[m.Payload]] = {
    s.RESPONSE_GENERATION: m.GenerationReport,
    s.COMPACTION_REQUEST: m.CompactionRequest,
    s.COMPACTION_RESULT: m.CompactionResult,
    s.COMPACTION_EVENT: m.CompactionEvent,
    s.QUERY_PREFIX: m.Query,
    s.REPLY_PREFIX: m.Reply,
    s.TOKEN_PREFIX: m.Token,
    s.STATE_PREFIX: m.StateChange,
    s.TOOL_PREFIX: m.ToolInvocation,
    s.ERROR_SUBJECT: m.ErrorReport,
}

PAYLOADS: tuple[type[m.Payload], ...] = (
    m.Query,
    m.Reply,
    m.Token,
    m.GenerationReport,
    m.CompactionRequest,
    m.CompactionResult,
    m.CompactionEvent,
    m.StateChange,
    m.ToolInvocation,
    m.ToolOutcome,
    m.ErrorReport,
)


def json_schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema of the enveloped message (and of history entries)."""
    out = {
        f"{payload.MESSAGE_TYPE}.json": Envelope[payload].model_json_schema()  # type: ignore[valid-type]
        for payload in PAYLOADS
    }
    out["history.entry.json"] = HistoryEntry.model_json_schema()
    return out
