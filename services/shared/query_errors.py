"""Error replies, kept for the QUERIES stream's duplicate window: the one
outcome of a query that the history does not hold (nothing is stored).

The generator keeps each before it sends it. A gateway reads them for a
message sent again under its `Idempotency-Key` (the stream drops the resend,
so no generator hears of it), and for the callers whose reply it may have
missed while its connection was away. Any gateway can: one started since the
error still tells the caller that error, not that it cannot know."""

from __future__ import annotations

import hashlib
import re

import structlog
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from schemas.messages import Reply
from services.shared.jetstream import query_errors_bucket

log = structlog.get_logger()
# The error of a query stopped while it waited for its turn.
WITHDRAWN_TEXT = ("withdrawn: stopped while it waited for its turn, so it was not answered "
                  "and nothing of it is stored")


# A KV key's alphabet, with dots only between tokens: narrower than a message
# id's (any 1-128 characters, from any publisher).
_KEY = re.compile(r"[-_=/A-Za-z0-9]+(\.[-_=/A-Za-z0-9]+)*")


def digest(question: str) -> str:
    return hashlib.sha256(question.encode()).hexdigest()


def key_of(query_id: str) -> str:
    """The bucket key a query's error is kept under: its id, or a digest of
    an id no key may spell (such an id crashed every redelivery's read)."""
    return query_id if _KEY.fullmatch(query_id) else "id-" + digest(query_id)


class KeptError(BaseModel):
    """An error reply as kept, with a digest of the message it answered: a
    resend under the same key with another message is refused, not told the
    first one's error."""

    reply: Reply
    question_digest: str | None = None  # None: kept without one

    def answers(self, question: str) -> bool:
        """Whether this error answered `question` (taken as yes when not known)."""
        return self.question_digest in (None, digest(question))


class QueryErrors:
    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._kv: KeyValue | None = None

    async def keep(self, reply: Reply, question: str, first: bool = False) -> bool:
        """Best effort: a reply NATS will not take is still sent (or not) on its
        own, and a resend then meets the key's other outcomes. `first`: only
        if no error is kept for the query yet; False when one is."""
        kept = KeptError(reply=reply, question_digest=digest(question))
        value = kept.model_dump_json().encode()
        try:
            bucket = await self._bucket()
            if first:
                await bucket.create(key_of(reply.query_id), value)
            else:
                await bucket.put(key_of(reply.query_id), value)
        except KeyWrongLastSequenceError:
            return False
        except Exception as err:
            log.warning("error_reply_not_kept", query_id=reply.query_id,
                        error=f"{type(err).__name__}: {err}")
        return True

    async def of(self, query_id: str) -> KeptError | None:
        """The error reply this query got within the window, if it got one."""
        try:
            entry = await (await self._bucket()).get(key_of(query_id))
        except KeyNotFoundError:
            return None
        try:
            return KeptError.model_validate_json(entry.value or b"")
        except ValidationError:
            pass
        try:  # kept before the digest was: the reply alone
            return KeptError(reply=Reply.model_validate_json(entry.value or b""))
        except ValidationError:
            log.warning("kept_error_reply_unreadable", query_id=query_id)
            return None

    async def reply_of(self, query_id: str) -> Reply | None:
        """The kept error reply alone, for those who need not compare messages."""
        kept = await self.of(query_id)
        return kept.reply if kept is not None else None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await query_errors_bucket(self._js)
        return self._kv
