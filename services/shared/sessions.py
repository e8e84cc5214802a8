"""Session records in the `sessions` KV bucket."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas import subjects
from schemas.session import SessionRecord
from services.shared.jetstream import bucket_keys, bucket_missing, sessions_bucket
from services.shared.recent import Recent


class SessionNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Stored:
    record: SessionRecord
    revision: int


class SessionStore:
    """Records are read through a per-process cache, written through it.

    What can change after creation is only calibration (and the model's
    window), which each writer refreshes from its own reports; a slightly
    stale ratio in another process is harmless, a round trip on every turn is
    not. Such a change is written over the revision read, never blindly: a
    session deleted meanwhile must not come back.
    """

    def __init__(self, js: JetStreamContext, kv: KeyValue, cached: bool = True,
                 cached_sessions: int = 10_000) -> None:
        self._js = js
        self._kv = kv
        self._cached = cached
        self._cache: Recent[str, Stored] = Recent(cached_sessions)

    @classmethod
    async def open(cls, js: JetStreamContext, cached: bool = True) -> SessionStore:
        """The store over the `sessions` bucket, made if it is missing."""
        return cls(js, await sessions_bucket(js), cached)

    async def create(self, record: SessionRecord) -> None:
        await self._kv.create(record.session_id, record.model_dump_json().encode())

    async def get(self, sid: str) -> SessionRecord:
        known = self._cache.get(sid) if self._cached else None
        if known is not None:
            return known.record
        stored = await self._load(sid)
        self._remember(stored)
        return stored.record

    def forget_all(self) -> None:
        """Read every record afresh: NATS came back, perhaps without its store."""
        self._cache.clear()

    def cached(self, sid: str) -> SessionRecord | None:
        """The record as this process last saw it, without asking anyone."""
        known = self._cache.get(sid)
        return None if known is None else known.record

    async def _load(self, sid: str) -> Stored:
        try:
            entry = await self._kv.get(sid)
        except KeyNotFoundError as err:
            raise SessionNotFound(sid) from err
        except NoRespondersError:
            # The bucket is missing (NATS came back without its store, and
            # it is not made again yet): no session exists yet.
            if not await bucket_missing(self._kv):
                raise
            raise SessionNotFound(sid) from None
        if entry.value is None or entry.revision is None:
            raise SessionNotFound(sid)
        return Stored(SessionRecord.model_validate_json(entry.value), entry.revision)

    async def newest(self, limit: int) -> list[SessionRecord]:
        """Up to `limit` sessions, newest first."""
        keys = await bucket_keys(self._js, subjects.SESSIONS_BUCKET)
        records = await asyncio.gather(*(self._load_or_none(k) for k in keys))
        found = [r for r in records if r is not None]
        return sorted(found, key=lambda r: r.created_at, reverse=True)[:limit]

    async def _load_or_none(self, sid: str) -> SessionRecord | None:
        try:
            return (await self._load(sid)).record
        except SessionNotFound:
            return None

    async def delete(self, sid: str) -> None:
        """Purge the record (no tombstone history kept) and forget it here."""
        self._cache.pop(sid)
        await self._kv.purge(sid)

    async def exists(self, sid: str) -> bool:
        """Asked of the bucket, never the cache: whether the session was deleted."""
        try:
            await self._load(sid)
        except SessionNotFound:
            return False
        return True

    async def update(self, record: SessionRecord) -> bool:
        """Store a changed record over the revision this process last read or
        wrote of it (read now, if it has none cached), if that is still the one
        stored. False when it is not: the session was deleted (its purge is a
        newer revision), or another process wrote it meanwhile; either way the
        next read sees what is stored."""
        sid = record.session_id
        known = self._cache.get(sid)
        try:
            last = known.revision if known is not None else (await self._load(sid)).revision
            revision = await self._kv.update(sid, record.model_dump_json().encode(), last=last)
        except (SessionNotFound, KeyWrongLastSequenceError):
            self._cache.pop(sid)
            return False
        self._remember(Stored(record, revision))
        return True

    def _remember(self, stored: Stored) -> None:
        if self._cached:
            self._cache.put(stored.record.session_id, stored)
