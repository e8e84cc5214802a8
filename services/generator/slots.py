"""The process's `MAX_CONCURRENT_SESSIONS` room, counted by session.

A session's queries in hand (the one being answered, and those waiting in
arrival order behind it) share one slot. Were each to take a slot of its
own, one client with a backlog would fill every slot with queries that only
wait, and no other session's query would even be pulled. A message not yet
decoded (its session unknown) and a compaction take a slot each.
"""

from __future__ import annotations


class Slots:
    def __init__(self, size: int) -> None:
        self._size = size
        # Holders whose session is not known (yet), or that have none.
        self._loose: set[object] = set()
        # Per session, the holders sharing its slot.
        self._sessions: dict[str, set[object]] = {}
        self._session_of: dict[object, str] = {}

    def free(self) -> int:
        return self._size - len(self._loose) - len(self._sessions)

    def holds(self, holder: object) -> bool:
        return holder in self._loose or holder in self._session_of

    def take(self, holder: object) -> None:
        """A slot of its own, until `join` or `give_back`."""
        self._loose.add(holder)

    def join(self, holder: object, sid: str) -> bool:
        """The holder turns out to be a query of `sid`, and shares that
        session's slot from now on. True when this gave a slot back (the
        session had one already)."""
        self._loose.discard(holder)
        sharing = self._sessions.setdefault(sid, set())
        had_one = bool(sharing)
        sharing.add(holder)
        self._session_of[holder] = sid
        return had_one

    def give_back(self, holder: object) -> bool:
        """The holder is done with its slot; True when a slot came free."""
        if holder in self._loose:
            self._loose.discard(holder)
            return True
        sid = self._session_of.pop(holder, None)
        if sid is None:
            return False  # given back already
        sharing = self._sessions[sid]
        sharing.discard(holder)
        if sharing:
            return False  # the session's next query goes on in it
        del self._sessions[sid]
        return True
