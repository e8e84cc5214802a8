"""Reading a session's transcript from its history subject, a page at a time
or as an export sent while it is read, and trimming it to the retention
setting without touching the context."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import subjects
from services.core.transcript import Item, MarkdownWriter, Position, StoredEntry, items_of
from services.shared.history_store import readable_entry

# Scrolling back: how much longer each stretch of the stream read is than the
# one before. Doubling reads at most about twice the entries a page needs.
STRETCH_GROWTH = 2


async def stored_entries(js: JetStreamContext, sid: str, from_seq: int = 1,
                         to_seq: int | None = None) -> AsyncIterator[StoredEntry]:
    """The session's entries from stream sequence `from_seq` to `to_seq`
    (None: the last one stored when the walk started), in order."""
    last = to_seq if to_seq is not None else await last_seq(js, sid)
    subject = subjects.history(sid)
    seq = max(from_seq, 1) - 1
    while seq < last:
        try:
            msg = await js.get_msg(subjects.HISTORY_STREAM, seq=seq + 1, subject=subject,
                                   next=True, direct=True)
        except NotFoundError:
            return
        seq = int(msg.seq or seq + 1)
        if seq > last:
            return
        entry = readable_entry(msg)
        if entry is not None:
            yield StoredEntry(seq, msg.time, entry)


async def last_seq(js: JetStreamContext, sid: str) -> int:
    """The stream sequence of the session's last entry; 0 if it has none."""
    try:
        msg = await js.get_last_msg(subjects.HISTORY_STREAM, subjects.history(sid), direct=True)
    except NotFoundError:
        return 0
    return int(msg.seq or 0)


async def page(js: JetStreamContext, sid: str, after: Position | None,
               limit: int, kind: str | None = None) -> tuple[list[Item], Position | None]:
    """Up to `limit` items past `after` (of one `kind`, if given), and the
    cursor of the next page (None when these are the last)."""
    found: list[Item] = []
    async for stored in stored_entries(js, sid, after.seq if after is not None else 1):
        for item in items_of(stored):
            if (after is not None and item.position <= after) or kind not in (None, item.kind):
                continue
            if len(found) == limit:
                return found, found[-1].position
            found.append(item)
    return found, None


async def page_before(js: JetStreamContext, sid: str, before: Position | None,
                      limit: int, kind: str | None = None) -> tuple[list[Item], Position | None]:
    """The `limit` items just before `before` (None: the end), of one `kind`
    if given, oldest first, and the cursor of the page before them (None at
    the start). The page scrolls back with it.

    Entries have no backward link on the stream, so stretches of it are read
    forward, each reaching further back than the one before (other sessions'
    entries lie between a session's), until they hold the page: a page costs
    a few reads more than it holds, however long the transcript."""
    top = before.seq if before is not None else await last_seq(js, sid)
    span = limit // 2 + 1  # enough when the session's turns lie side by side
    kept: list[Item] = []
    while top >= 1 and len(kept) <= limit:
        low = max(1, top - span + 1)
        kept = [item async for stored in stored_entries(js, sid, low, top)
                for item in items_of(stored)
                if (before is None or item.position < before) and kind in (None, item.kind)
                ] + kept
        top, span = low - 1, span * STRETCH_GROWTH
    items = kept[-(limit + 1):]
    if len(items) > limit:
        return items[1:], items[1].position
    return items, None


async def markdown_export(js: JetStreamContext, sid: str) -> AsyncIterator[str]:
    """The session's transcript as Markdown, a stored entry at a time: an
    export's memory holds one entry, however long the transcript."""
    writer = MarkdownWriter(sid)
    yield writer.head()
    async for stored in stored_entries(js, sid):
        yield "".join(writer.item(item) for item in items_of(stored))
    yield writer.end()


async def json_export(js: JetStreamContext, sid: str) -> AsyncIterator[str]:
    """`{"session_id": ..., "items": [...]}`, a stored entry at a time."""
    yield f'{{"session_id": {json.dumps(sid)}, "items": ['
    separator = ""
    async for stored in stored_entries(js, sid):
        for item in items_of(stored):
            yield separator + json.dumps(item.as_json())
            separator = ", "
    yield "]}"


async def trim(js: JetStreamContext, sid: str, base_seq: int, max_age_s: float,
               now: datetime | None = None) -> int:
    """Drop the session's entries older than `max_age_s`, but never one the
    context needs: its snapshot at `base_seq`, and the turns holding the
    messages that snapshot kept (shown before its marker). Returns the
    sequence below which nothing is kept now (0: nothing dropped)."""
    if base_seq == 0:
        return 0  # never compacted: the context is the whole transcript
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=max_age_s)
    before: list[StoredEntry] = []
    async for stored in stored_entries(js, sid):
        if stored.seq >= base_seq:
            snapshot = stored.entry.snapshot
            kept = len(snapshot.messages) if snapshot is not None else 0
            break
        before.append(stored)
    else:
        return 0  # the snapshot is not there: nothing is judged without it
    keep_from = oldest_needed(before, kept, base_seq)
    for stored in before:
        if stored.time is None or stored.time >= cutoff:
            keep_from = min(keep_from, stored.seq)
            break
    if not before or keep_from <= before[0].seq:
        return 0
    await js.purge_stream(subjects.HISTORY_STREAM, subject=subjects.history(sid), seq=keep_from)
    return keep_from


def oldest_needed(before: list[StoredEntry], kept: int, base_seq: int) -> int:
    """The sequence of the oldest entry holding one of the last `kept`
    messages before the snapshot (`base_seq` when it kept none)."""
    needed = base_seq
    for stored in reversed(before):
        if kept <= 0:
            break
        if stored.entry.kind == "turn":
            kept -= len(stored.entry.messages)
        needed = stored.seq
    return needed
