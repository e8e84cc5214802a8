"""Every payload, and the JSON Schema of each one in its envelope.

Which payload travels on which subject is the table in ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import Any

from schemas import messages as m
from schemas.envelope import Envelope
from schemas.history import HistoryEntry

PAYLOADS: tuple[type[m.Payload], ...] = (
    m.Query,
    m.Reply,
    m.Token,
    m.StopRequest,
    m.StopAccepted,
    m.GenerationReport,
    m.CompactionRequest,
    m.CompactionResult,
    m.CompactionEvent,
    m.StateChange,
    m.SessionDeleted,
    m.ToolInvocation,
    m.ToolOutcome,
    m.ToolListRequest,
    m.ToolDefinitions,
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
