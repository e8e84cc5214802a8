"""A session's history on the HISTORY stream, read and written with
compare-and-swap.

Every write names the sequence of the last message it has seen on the
session's subject (`Nats-Expected-Last-Subject-Sequence`). A writer holding a
stale view (a frozen lock holder whose lease lapsed, a compaction whose
snapshot is old) is refused by the server: `HistoryConflict`. A compaction
splice is one snapshot message on the same subject: nothing is deleted (the
subject is the session's transcript), and the context is read from the latest
snapshot on, found through the `base` every turn names, so reading it costs
the same however long the transcript grows.

Reads keep a per-session cache keyed by the last sequence seen, so a turn
costs one "last message" lookup when nothing changed behind our back, and
none when the caller knows nobody else can have written. A process that
`follow`s the stream also takes other processes' writes into its cached
views as they happen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, RawStreamMsg
from nats.js.errors import APIError, NotFoundError
from pydantic import ValidationError

from schemas import subjects
from schemas.history import ChatMessage, Conversation, HistoryEntry, Snapshot
from services.shared.jetstream import missing
from services.shared.nats_away import patiently
from services.shared.recent import Recent
from services.shared.together import together

log = structlog.get_logger()

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = (10071, 10164)


class HistoryConflict(Exception):
    """Someone wrote the session's history since this view was read."""


@dataclass(frozen=True)
class HistoryView:
    conversation: Conversation
    # Stream sequence of the subject's last message; 0 when it has none.
    last_seq: int
    # Stream sequence of the snapshot the context starts at; 0 when none.
    base_seq: int = 0


EMPTY = HistoryView(Conversation(), 0)


@dataclass(frozen=True)
class Cached:
    """A view kept in memory, and the last sequence `follow` saw its session
    reach when that is beyond the view (the view is stale). One entry for
    both, so a mark lives exactly as long as the view it marks."""

    view: HistoryView
    seen: int = 0

    @property
    def current(self) -> bool:
        return self.seen <= self.view.last_seq


class HistoryStore:
    def __init__(self, js: JetStreamContext, cached_sessions: int = 512,
                 on_foreign_write: Callable[[str], None] = lambda sid: None,
                 nats_patience_s: float = 0.0) -> None:
        self._js = js
        # How long a write NATS does not answer is tried again (a turn's
        # answer or a summary is dear to make anew; see `_write`).
        self._nats_patience_s = nats_patience_s
        # Told of each write `follow` sees another process make to a session
        # whose view this process keeps.
        self._on_foreign_write = on_foreign_write
        # Bounded, so a long-lived process serving many sessions keeps only
        # the ones used lately in memory.
        self._cache: Recent[str, Cached] = Recent(cached_sessions)
        # Per session, the sequence our write in flight expects to follow.
        self._writing: dict[str, str] = {}

    async def follow(self, idle_heartbeat_s: float = 5.0) -> JetStreamContext.PushSubscription:
        """Keep cached views up to date as other processes write: each write
        that extends a cached view is applied to it; any other makes the view
        stale (`cached` then has none, and `read` asks the server). It may
        come late, so it never spares a compare-and-swap: it only makes a
        cached view current more often, and lets a stale one be known.

        The consumer lives in the server's memory. When its heartbeats stop
        for two periods (the server restarted, say), nats-py makes a new one
        that starts after the last write seen, and keeps trying until NATS
        answers: nothing written meanwhile is missed."""
        return await self._js.subscribe(
            f"{subjects.HISTORY_PREFIX}.*", stream=subjects.HISTORY_STREAM, cb=self._on_write,
            ordered_consumer=True, deliver_policy=DeliverPolicy.NEW,
            idle_heartbeat=idle_heartbeat_s)

    async def follow_again(self, old: JetStreamContext.PushSubscription | None
                           ) -> JetStreamContext.PushSubscription:
        """Follow anew once NATS is back, without waiting for nats-py to miss
        two heartbeats; and forget every cached view, since writes made
        before the new follower started were seen by nobody (on a store made
        anew, the old follower would start past them all)."""
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        following = await self.follow()
        self.forget_all()
        return following

    async def _on_write(self, msg: Msg) -> None:
        sid = msg.subject.partition(".")[2]
        kept, seq = self._cache.get(sid), msg.metadata.sequence.stream
        if kept is None or seq <= kept.view.last_seq:
            return  # not kept here, or known already
        view = kept.view
        expected = (msg.headers or {}).get(EXPECTED_LAST_SUBJECT_SEQ)
        if expected is not None and self._writing.get(sid) == expected:
            return  # our own write: its acknowledgement is on its way
        self._on_foreign_write(sid)
        if expected == str(view.last_seq):
            with contextlib.suppress(ValidationError):
                entry = HistoryEntry.model_validate_json(msg.data)
                self._remember(sid, _applied(view, entry, seq))
                return
        # Marked, not used: the mark leaves the view's place in the cache as is.
        self._cache.replace(sid, Cached(view, max(seq, kept.seen)))

    def cached(self, sid: str) -> HistoryView | None:
        """The view this process last read, wrote or followed, unless it
        knows of a later write; asks nobody."""
        kept = self._cache.get(sid)
        if kept is None or not kept.current:
            return None
        return kept.view

    async def read(self, sid: str, current: bool = False, at: int | None = None
                   ) -> HistoryView:
        """The session's history. `current`: the caller knows nobody else has
        written it since this process did (it took the lock back from itself),
        so a cached view is returned without asking the server, unless
        following has seen a later write. `at`: the caller knows the history
        ends at that sequence (the lock's previous holder said so), so a
        cached view that ends there is returned likewise. Were either wrong,
        the next append's compare-and-swap would still refuse it."""
        known = self.cached(sid)
        if known is not None and (current or known.last_seq == at):
            self._cache.put(sid, Cached(known))  # used now
            return known
        subject = subjects.history(sid)
        kept = self._cache.get(sid)
        cached = kept.view if kept is not None else EMPTY
        last_msg, first_new = await self._last_and_next(subject, cached.last_seq)
        last = int(last_msg.seq or 0) if last_msg is not None else 0
        if last == cached.last_seq:
            if kept is not None:
                # Used now. (A mark beyond it stays: that write came after the look-up.)
                self._cache.put(sid, kept)
            return cached
        if last < cached.last_seq:  # purged below what we have: start over
            self.forget(sid)
            cached, first_new = EMPTY, None
        if last_msg is None:  # purged: the session was deleted
            return EMPTY
        base = _base_of(last_msg)
        if base > cached.last_seq:
            # A snapshot we have not seen: the context starts there, and what
            # lies before it (the transcript) is never read for it.
            cached, first_new = EMPTY, None
            first_new = last_msg if base == last else await self._entry_after(subject, base - 1)
        view = await self._read_up_to(subject, last, cached, first_new)
        self._remember(sid, view)
        return view

    async def _last_and_next(self, subject: str, seen: int
                             ) -> tuple[RawStreamMsg | None, RawStreamMsg | None]:
        """The subject's last entry, and the first after `seen`.

        Asked together: whether anything changed, and the first of what did.
        Catching up on one turn then takes one round trip, not three; when
        nothing changed, the second request was not needed."""
        last_msg, first_new = await together(
            self._last_msg(subject), self._entry_after(subject, seen))
        if isinstance(last_msg, Exception):
            raise last_msg
        if isinstance(first_new, Exception):
            raise first_new
        return last_msg, first_new

    async def append(
        self, sid: str, view: HistoryView, messages: Sequence[ChatMessage],
        supersedes: str | None = None,
    ) -> HistoryView:
        """Append one turn's messages after `view`, in one write.

        No `Nats-Msg-Id` here: the server checks the expected sequence before
        duplicates, so a retry whose first attempt was stored fails as a
        conflict either way. What makes a retried turn harmless is its query
        id on every message: the redelivered query finds its stored answer.
        `supersedes`: a retried answer's, see `HistoryEntry`."""
        entry = HistoryEntry.of_turn(tuple(messages), view.base_seq, supersedes)
        seq = await self._write(sid, entry, view.last_seq, {})
        view = _applied(view, entry, seq)
        self._remember(sid, view)
        return view

    async def splice(self, sid: str, view: HistoryView, snapshot: Snapshot) -> HistoryView:
        """Write the snapshot after `view`, in one write: from its sequence on
        the context is the snapshot's; the turns before it stay, as transcript."""
        entry = HistoryEntry.of_snapshot(snapshot)
        seq = await self._write(sid, entry, view.last_seq, {})
        spliced = _applied(view, entry, seq)
        self._remember(sid, spliced)
        return spliced

    async def discard(self, sid: str) -> None:
        """Purge all the session's subject holds: a first turn stored after
        its session was deleted (the purge left the subject empty, as the
        first append expects, so its compare-and-swap could not tell)."""
        self.forget(sid)
        await self._js.purge_stream(subjects.HISTORY_STREAM, subject=subjects.history(sid))

    def forget(self, sid: str) -> None:
        self._cache.pop(sid)

    def forget_all(self) -> None:
        """Read every session afresh: NATS came back, perhaps with a store
        made anew whose sequences mean something else."""
        self._cache.clear()

    async def _write(
        self, sid: str, entry: HistoryEntry, expected: int, extra: dict[str, str]
    ) -> int:
        headers = {EXPECTED_LAST_SUBJECT_SEQ: str(expected), **extra}
        self._writing[sid] = headers[EXPECTED_LAST_SUBJECT_SEQ]
        data = entry.model_dump_json().encode()
        try:
            # Safe to repeat: a first try that was stored after all makes the
            # next one a conflict, which a redelivery settles from the history.
            ack = await patiently(
                lambda: self._js.publish(subjects.history(sid), data, headers=headers),
                self._nats_patience_s, "history_write_tried_again")
        except Exception as err:
            # Refused, or not answered (then it may be stored all the same, and
            # following skips our own writes): read afresh next time.
            self.forget(sid)
            if isinstance(err, APIError) and err.err_code in WRONG_LAST_SEQUENCE:
                raise HistoryConflict(
                    f"history of {sid} changed since sequence {expected}") from err
            raise
        finally:
            self._writing.pop(sid, None)
        return int(ack.seq)

    async def _last_msg(self, subject: str) -> RawStreamMsg | None:
        return await self._entry_or_none(
            self._js.get_last_msg(subjects.HISTORY_STREAM, subject, direct=True))

    async def _entry_after(self, subject: str, seq: int) -> RawStreamMsg | None:
        return await self._entry_or_none(self._js.get_msg(
            subjects.HISTORY_STREAM, seq=seq + 1, subject=subject, next=True, direct=True))

    async def _entry_or_none(self, read: Awaitable[RawStreamMsg]) -> RawStreamMsg | None:
        """The entry read, or None when there is none."""
        try:
            return await read
        except NotFoundError:
            return None
        except NoRespondersError:
            # The stream is missing (NATS came back without it, and it is not
            # made again yet): it holds nothing yet. Otherwise an error.
            if not await missing(self._js, subjects.HISTORY_STREAM):
                raise
            return None

    async def _read_up_to(self, subject: str, last: int, start: HistoryView,
                          first: RawStreamMsg | None) -> HistoryView:
        """The view at sequence `last`: what `start` lacks, entry by entry. (A
        write after `last` is for the next read, and the compare-and-swap of
        our own next write would refuse a view without it.)"""
        view = start
        msg = first or await self._entry_after(subject, view.last_seq)
        while msg is not None:
            seq = int(msg.seq or view.last_seq + 1)
            entry = readable_entry(msg)
            view = (_applied(view, entry, seq) if entry is not None
                    else HistoryView(view.conversation, seq, view.base_seq))
            msg = await self._entry_after(subject, view.last_seq) if view.last_seq < last else None
        return view

    def _remember(self, sid: str, view: HistoryView) -> None:
        known = self._cache.get(sid)
        if known is not None and known.view.last_seq > view.last_seq:
            # A read without the lock (a compaction's) finished after a newer
            # view came in (our append, or following): keep the newer one.
            return
        seen = known.seen if known is not None and known.seen > view.last_seq else 0
        self._cache.put(sid, Cached(view, seen))


def _applied(view: HistoryView, entry: HistoryEntry, seq: int) -> HistoryView:
    """`view` with `entry`, stored at `seq`, folded in."""
    base = seq if entry.kind == "snapshot" else view.base_seq
    return HistoryView(view.conversation.apply(entry), seq, base)


def _base_of(msg: RawStreamMsg) -> int:
    """Where the context that `msg` ends starts: the snapshot's own sequence,
    or the one a turn names (for one that cannot be read, the start)."""
    entry = readable_entry(msg)
    if entry is None:
        return 0
    return int(msg.seq or 0) if entry.kind == "snapshot" else entry.base


def readable_entry(msg: RawStreamMsg) -> HistoryEntry | None:
    """The entry `msg` holds, or None, logged, for one no reader can take in
    (written by another program, say): passed over, not fatal to the session,
    and left in the stream, which only an explicit delete empties."""
    try:
        return HistoryEntry.model_validate_json(msg.data or b"")
    except ValidationError as err:
        log.warning("history_entry_unreadable", subject=msg.subject, seq=msg.seq,
                    errors=err.error_count())
        return None
