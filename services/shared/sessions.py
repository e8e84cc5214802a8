"""Session records in the `sessions` KV bucket."""

from __future__ import annotations

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from schemas.session import SessionRecord


class SessionNotFound(LookupError):
    pass


class SessionStore:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def create(self, record: SessionRecord) -> None:
        await self._kv.create(record.session_id, record.model_dump_json().encode())

    async def get(self, sid: str) -> SessionRecord:
        try:
            entry = await self._kv.get(sid)
        except KeyNotFoundError as err:
            raise SessionNotFound(sid) from err
        if entry.value is None:
            raise SessionNotFound(sid)
        return SessionRecord.model_validate_json(entry.value)

    async def put(self, record: SessionRecord) -> None:
        await self._kv.put(record.session_id, record.model_dump_json().encode())
