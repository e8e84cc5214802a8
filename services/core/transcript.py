"""The transcript of a session, as a person reads it: every message ever
accepted or answered, in order, with a marker at each compaction.

Pure: turns the entries of a session's history subject (each with its stream
sequence and time) into items, pages them and renders them as Markdown
(`recall` searches them). A snapshot's kept messages are copies of messages already in
the transcript, so a snapshot becomes one compaction marker and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from schemas.history import ChatMessage, HistoryEntry, Snapshot
from services.core.numbers import whole_number

DEFAULT_PAGE = 200
MAX_PAGE = 1000


class InvalidCursor(ValueError):
    pass


@dataclass(frozen=True, order=True)
class Position:
    """Where an item is: its entry's stream sequence, and its index there."""

    seq: int
    index: int = 0

    def __str__(self) -> str:
        return f"{self.seq}-{self.index}"

    @classmethod
    def parse(cls, text: str) -> Position:
        seq, sep, index = text.partition("-")
        seq_number, index_number = whole_number(seq), whole_number(index)
        if not sep or seq_number is None or index_number is None:
            raise InvalidCursor("cursor: use the 'next' of a previous page")
        return cls(seq_number, index_number)


@dataclass(frozen=True)
class StoredEntry:
    seq: int
    time: datetime | None
    entry: HistoryEntry


@dataclass(frozen=True)
class Item:
    position: Position
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    def as_json(self) -> dict[str, Any]:
        return {**self.body, "position": str(self.position)}


def items_of(stored: StoredEntry) -> list[Item]:
    entry = stored.entry
    if entry.kind == "snapshot" and entry.snapshot is not None:
        return [Item(Position(stored.seq), marker(entry.snapshot, stored.time))]
    # A retried answer names the query whose answer it replaces, so a reader
    # can mark the older one superseded (it stays in the transcript).
    extra = {"supersedes": entry.supersedes} if entry.supersedes is not None else {}
    return [Item(Position(stored.seq, i), {**message_item(m), **extra})
            for i, m in enumerate(entry.messages)]


def message_item(message: ChatMessage) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "message", "role": message.role, "content": message.content}
    if message.tool_calls:
        body["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_name is not None:
        body["tool_name"] = message.tool_name
    if message.query_id is not None:
        body["query_id"] = message.query_id
    if message.stopped:
        body["stopped"] = True
    for name in ("prompt_tokens", "completion_tokens"):
        if (count := getattr(message, name)) is not None:
            body[name] = count
    return body


def marker(snapshot: Snapshot, stored_at: datetime | None) -> dict[str, Any]:
    at = snapshot.at or stored_at
    return {
        "kind": "compaction", "at": at.isoformat() if at is not None else None,
        "auto": snapshot.auto, "level": snapshot.level,
        "tokens_before": snapshot.tokens_before, "tokens_after": snapshot.tokens_after,
        "summary": snapshot.summary, "compactions": snapshot.compactions,
        # The last this many messages before the marker stay in the context,
        # not counting the answers a retry before it replaced (already out).
        "kept_messages": len(snapshot.messages),
    }


def items_after(entries: Iterable[StoredEntry], after: Position | None) -> Iterator[Item]:
    """Every item of `entries` (in stream order) past `after`."""
    for stored in entries:
        for item in items_of(stored):
            if after is None or item.position > after:
                yield item


def page_limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_PAGE
    limit = whole_number(raw, 1, MAX_PAGE)
    if limit is None:
        raise ValueError(f"limit: a whole number from 1 to {MAX_PAGE}")
    return limit


def markdown(session_id: str, items: Iterable[Item]) -> str:
    writer = MarkdownWriter(session_id)
    return writer.head() + "".join(writer.item(item) for item in items) + writer.end()


class MarkdownWriter:
    """A transcript's Markdown, an item at a time: what `markdown` makes whole,
    in pieces an export sends while it reads, so its memory never holds the
    whole transcript. Trailing white space is held back, since the document
    ends without it."""

    def __init__(self, session_id: str) -> None:
        self._session_id = session_id
        self._held = ""

    def head(self) -> str:
        return self._take(f"# Session {self._session_id}\n")

    def item(self, item: Item) -> str:
        return self._take("\n" + "\n".join(_markdown_item(item.body)))

    def end(self) -> str:
        return "\n"

    def _take(self, text: str) -> str:
        text = self._held + text
        shown = text.rstrip()
        self._held = text[len(shown):]
        return shown


def _markdown_item(body: dict[str, Any]) -> list[str]:
    if body["kind"] == "compaction":
        return ["---", "", f"*{divider(body)}*", "", "> " + "\n> ".join(
            str(body.get("summary") or "(no summary: old tool output elided)").splitlines()),
                "", "---", ""]
    title = body["role"] if "tool_name" not in body else f"tool ({body['tool_name']})"
    lines = [f"**{title}**", ""]
    if body["content"]:
        lines += [str(body["content"]), ""]
    for call in body.get("tool_calls", []):
        lines += [f"`{call['name']}({call['arguments']})`", ""]
    return lines


def divider(body: dict[str, Any]) -> str:
    """The one-line description of a compaction marker."""
    auto = body.get("auto")
    how = "" if auto is None else "automatic" if auto else "manual"
    sizes = ""
    if body.get("tokens_before") is not None and body.get("tokens_after") is not None:
        sizes = f"{body['tokens_before']:,} → {body['tokens_after']:,} tokens"
    level = "" if body.get("level") in (None, "gentle") else str(body["level"])
    parts = ["compacted", how, level, sizes, _when(body.get("at"))]
    return " · ".join(p for p in parts if p)


def _when(at: object) -> str:
    try:
        moment = datetime.fromisoformat(str(at))
    except ValueError:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
