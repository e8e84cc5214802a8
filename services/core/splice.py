"""The compaction splice: summary + every message after the boundary.

A compaction snapshots the history, summarises the compact zone while turns
go on, then splices under the session lock. Messages appended since the
snapshot are all kept, so the live zone never shrinks; if the history no
longer starts with the snapshot's compact zone (another compaction got there
first), the splice refuses instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.history import ChatMessage, Conversation, Snapshot
from services.core.boundary import choose_boundary, elide_tool_output

# How many folded query ids a snapshot keeps. Only a query still in the work
# queue can come back, and a session's later queries wait until the server
# took an earlier one's acknowledgement, so just the last few can be answered
# and still unacknowledged; the rest is margin, at about 35 bytes an id.
KEPT_QUERY_IDS = 256


class SpliceConflict(Exception):
    """The history changed under the snapshot in a way a splice cannot absorb."""


@dataclass(frozen=True)
class CompactionPlan:
    snapshot: Conversation
    boundary: int

    def __post_init__(self) -> None:
        if not 0 < self.boundary <= len(self.snapshot.messages):
            raise ValueError(
                f"boundary {self.boundary} outside 1..{len(self.snapshot.messages)}"
            )

    @property
    def to_compact(self) -> tuple[ChatMessage, ...]:
        return self.snapshot.messages[: self.boundary]

    @property
    def live(self) -> tuple[ChatMessage, ...]:
        return self.snapshot.messages[self.boundary :]


def plan_compaction(snapshot: Conversation, tail_turns: int) -> CompactionPlan | None:
    """What to compact in this snapshot, or None when nothing lies before the live zone."""
    boundary = choose_boundary(snapshot.messages, tail_turns)
    if boundary == 0:
        return None
    return CompactionPlan(snapshot, boundary)


def splice(current: Conversation, plan: CompactionPlan, summary: str) -> Snapshot:
    """The snapshot appended after `current`: the new summary, then messages[boundary:]."""
    if not summary.strip():
        raise ValueError("an empty summary is never spliced")
    _check_unchanged(current, plan)
    return Snapshot(
        summary=summary,
        messages=current.messages[plan.boundary :],
        compactions=current.compactions + 1,
        compacted_query_ids=compacted_query_ids(current, plan.boundary),
    )


def compacted_query_ids(current: Conversation, boundary: int,
                        keep: int = KEPT_QUERY_IDS) -> tuple[str, ...]:
    """The ids of the queries folded so far, then those of the messages
    before `boundary`, each once, in order, the last `keep` of them."""
    folded = (m.query_id for m in current.messages[:boundary] if m.query_id is not None)
    # A superseded retry's answer is gone from the context already; its id
    # must outlive the snapshot all the same (`Conversation.answered`).
    ids = dict.fromkeys((*current.compacted_query_ids, *current.superseded_query_ids, *folded))
    return tuple(ids)[-keep:] if keep > 0 else ()


def splice_elided(current: Conversation, plan: CompactionPlan, max_chars: int = 200) -> Snapshot:
    """The structural fallback when no summary could be written: every message
    stays, but tool output in the compact zone is cut to `max_chars` characters
    (the previous summary, if any, is kept as it is)."""
    _check_unchanged(current, plan)
    zone = elide_tool_output(current.messages[: plan.boundary], keep_last=0, max_chars=max_chars)
    return Snapshot(
        summary=current.summary,
        messages=(*zone, *current.messages[plan.boundary :]),
        compactions=current.compactions + 1,
        compacted_query_ids=compacted_query_ids(current, 0),  # every message stays
    )


def _check_unchanged(current: Conversation, plan: CompactionPlan) -> None:
    """Only the compact zone must be as it was: the live zone is kept as it is
    now, whatever turns or retries changed it meanwhile."""
    snapshot = plan.snapshot
    if (
        current.summary != snapshot.summary
        or current.compactions != snapshot.compactions
        or current.messages[: plan.boundary] != plan.to_compact
    ):
        raise SpliceConflict(
            "history no longer starts with the compacted zone "
            f"(compactions {snapshot.compactions} -> {current.compactions}, "
            f"{len(snapshot.messages)} -> {len(current.messages)} messages)"
        )


def first_user_request(conversation: Conversation) -> str | None:
    """The session's first user request while it is still raw; once a summary
    is written it carries the request, so None. (A compaction that only cut
    old tool output leaves every message, the first request included.)"""
    if conversation.summary is not None:
        return None
    for message in conversation.messages:
        if message.role == "user":
            return message.content
    return None
