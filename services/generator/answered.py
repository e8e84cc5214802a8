"""What this process remembers of the queries it answered lately: the
acknowledgements the server confirmed (the ordering check skips those), the
error replies (a query coming back is answered with the same one), and each
query's failed tries (when to give up on it)."""

from __future__ import annotations

import asyncio
import time

from schemas.messages import Reply
from services.core.failed_tries import Failure, GiveUp, Tries, TryAgain, after_failure
from services.shared.jetstream import no_room
from services.shared.nats_away import NATS_AWAY
from services.shared.recent import Recent

# Stream sequences of the queries answered last, kept for the ordering check.
REMEMBERED_ANSWERS = 4096


class AnsweredQueries:
    """Queries this process answered lately, by stream sequence, and whether
    the server confirmed their acknowledgements.

    The server drops an acknowledged query from the work queue a moment
    after the acknowledgement, and the session's next query must not wait
    for it: the ordering check skips a query whose acknowledgement the
    server confirmed (waiting for a confirmation on its way). One merely
    sent may be lost (the connection drops with it, or it is refused); were
    it skipped, the later queries would run and the earlier one would come
    back after them, maybe after a compaction folded its turn away.

    An error reply is kept too, confirmed or not. Nothing of such a query is
    stored, so if its acknowledgement is lost and the query comes back, only
    this memory (or, in another process, the `query_errors` bucket) stops it
    from being answered a second time, after the session's later queries.
    An answer is not kept: the history holds it, tagged with the query's id."""

    def __init__(self, size: int = REMEMBERED_ANSWERS) -> None:
        self._errors: Recent[int, Reply] = Recent(size)
        # Per stream sequence: the query's id and the server's word on its ack.
        self._acks: Recent[int, tuple[str, asyncio.Future[bool]]] = Recent(size)
        self.count = 0

    def remember(self, stream_seq: int, reply: Reply, confirmation: asyncio.Future[bool]
                 ) -> None:
        if reply.error:
            self._errors.put(stream_seq, reply)
        self._acks.put(stream_seq, (reply.query_id, confirmation))
        self.count += 1

    def error_reply(self, stream_seq: int, query_id: str) -> Reply | None:
        """The error this query was answered with here, if it was. (The id is
        checked too: a stream made anew numbers its messages from 1 again.)"""
        reply = self._errors.get(stream_seq)
        return reply if reply is not None and reply.query_id == query_id else None

    async def acknowledged(self, stream_seq: int, query_id: str | None = None) -> bool:
        """Whether the server confirmed this process's acknowledgement of the
        query. The id is checked too, when known: a stream made anew (NATS
        came back without its store) numbers its messages from 1 again, and
        an earlier query must not be skipped because one of the old stream
        had its sequence."""
        kept = self._acks.get(stream_seq)
        if kept is None or query_id not in (None, kept[0]):
            return False
        ack = kept[1]
        if not ack.done():
            await asyncio.wait([ack])  # not cancelled with the waiter: others may wait too
        return not ack.cancelled() and ack.result()

    def cancel_pending(self) -> None:
        for _, (_, ack) in self._acks.items():
            ack.cancel()


def failure_of(err: Exception) -> Failure:
    if no_room(err):
        return Failure.no_room
    return Failure.nats_away if isinstance(err, NATS_AWAY) else Failure.crash


class FailedTries:
    """Each query's failed attempts lately in this process (see
    `services.core.failed_tries`). Not its delivery count: a query handed
    back to keep its session's order, or because the lock was busy, comes
    again without having failed."""

    def __init__(self, nats_patience_s: float, size: int = REMEMBERED_ANSWERS) -> None:
        self._tries: Recent[str, Tries] = Recent(size)
        self._patience_s = nats_patience_s

    def count(self, query_id: str, err: Exception) -> TryAgain | GiveUp:
        """Count this failure of the query; says what to do next."""
        tries, outcome = after_failure(self._tries.get(query_id) or Tries(),
                                       failure_of(err), time.monotonic(), self._patience_s)
        self._tries.put(query_id, tries)
        return outcome
