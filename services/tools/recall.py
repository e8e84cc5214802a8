"""`recall(query, limit)`: the model gets back what compaction took out of its
context, by searching its own session's transcript.

The session comes from the call's envelope (set by the generator running the
turn), never from an argument, so no call can read another session."""

from __future__ import annotations

import json
from typing import Any

from nats.js import JetStreamContext

from schemas.messages import ToolOutcome
from services.core.recall import Recall
from services.core.transcript import items_of
from services.shared.transcript import stored_entries

NAME = "recall"
DEFAULT_LIMIT = 5
MAX_LIMIT = 20
# A match is shown cut to this many characters: recall must not flood the context.
MAX_MATCH_CHARS = 1000

DEFINITION: dict[str, Any] = {"type": "function", "function": {
    "name": NAME,
    "description": "Search this conversation's full transcript, including the part that "
                   "was compacted into the summary. Matches every word of the query "
                   "(case-insensitive), newest first.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "description": "words to look for"},
        "limit": {"type": "integer", "description": f"at most this many (1-{MAX_LIMIT})"},
    }, "required": ["query"]},
}}


async def run_recall(js: JetStreamContext, session_id: str | None,
                     arguments: dict[str, Any]) -> ToolOutcome:
    if session_id is None:
        return ToolOutcome(name=NAME, error="recall is only available inside a session")
    query, limit = arguments.get("query"), arguments.get("limit", DEFAULT_LIMIT)
    if not isinstance(query, str) or not query.strip():
        return ToolOutcome(name=NAME, error="bad arguments: query must be a non-empty string")
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        return ToolOutcome(name=NAME, error=f"bad arguments: limit must be 1 to {MAX_LIMIT}")
    # Read an entry at a time: only the newest matches are held, never the transcript.
    search = Recall(query, limit, own_tool=NAME)
    async for stored in stored_entries(js, session_id):
        search.take(items_of(stored))
    found = search.found()
    matches = [{"position": str(i.position), "role": i.body["role"],
                "content": str(i.body["content"])[:MAX_MATCH_CHARS]} for i in found]
    # Unescaped: a model reads `\u9884` badly, and at several times the tokens.
    return ToolOutcome(name=NAME, content=json.dumps({"matches": matches}, ensure_ascii=False))
