"""A caller's `Idempotency-Key`: one message, one turn, however often it is sent.

A caller that did not hear back (its connection dropped, the gateway said
`nats_unavailable` after a publish NATS may have kept all the same) cannot
tell whether its message was taken. Sent again under the same key, it is
answered once: the key names the query, so the QUERIES stream keeps a
resend within its duplicate window once, and the generator answers a later
one from the history (as it does a redelivery). The gateway looks in the
history first, so a resend after the answer is served without a publish.

The key is the caller's and may be any short string: the query's id is a
digest of it with the session's id and the route (a message or a retry), so
two sessions, or a message and a retry, never share one, and the id has the
shape of every other.
"""

from __future__ import annotations

import hashlib
import re

from schemas.history import Conversation
from schemas.messages import Reply
from services.shared.query_errors import KeptError

HEADER = "idempotency-key"
# Printable ASCII without spaces, as long as the common UUIDs and ULIDs and more.
VALID_KEY = re.compile(r"[\x21-\x7e]{1,255}")


class InvalidKey(ValueError):
    pass


class KeyReused(Exception):
    """The key was sent before with another message."""


def key_of(header: str | None) -> str | None:
    """The caller's key, from the header's value (a quoted string, as the
    IETF draft writes it, or bare); None without the header."""
    if header is None:
        return None
    key = header.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    if not VALID_KEY.fullmatch(key):
        raise InvalidKey("Idempotency-Key: 1-255 printable ASCII characters, no spaces")
    return key


def query_id_for(session_id: str, key: str, retry: bool) -> str:
    """The query's id for a caller's key: the same in every gateway and on
    every resend, and never the same for two sessions, or for a message and
    a retry."""
    kind = "retry" if retry else "message"
    return hashlib.sha256(f"{session_id}\n{kind}\n{key}".encode()).hexdigest()[:32]


def earlier_outcome(conversation: Conversation, session_id: str, query_id: str,
                    content: str) -> Reply | None:
    """What became of a query sent before under this id: its reply, if the
    history holds one; None if nothing is stored of it yet. KeyReused when
    the history holds another message under it. (A retry stores no message
    of its own: the one it answers again is another query's.)"""
    same_message(conversation.question(query_id), content)
    return conversation.answered(session_id, query_id)


def kept_outcome(kept: KeptError | None, content: str) -> Reply | None:
    """The error reply kept for a query sent before under this id, if one is;
    KeyReused when it answered another message than the one resent."""
    if kept is None:
        return None
    if not kept.answers(content):
        raise KeyReused
    return kept.reply


def same_message(first: str | None, resent: str) -> None:
    """KeyReused unless a resend carries the message its key was first sent
    with (None: the first is not known, or could not be read; not compared)."""
    if first is not None and first != resent:
        raise KeyReused
