"""Every NATS subject, stream and bucket name the services use, in one place.

The three contract subjects keep their exact names. Per-session subjects put
the session id in the last token, and only after `session_id()` has accepted
it: a `.`, `*`, `>` or blank in an id would let one session read or write
another's traffic.
"""

from __future__ import annotations

import re

# The contract: other implementations of any service depend on these names.
RESPONSE_GENERATION = "response.generation"
COMPACTION_REQUEST = "compaction.request"
COMPACTION_RESULT = "compaction.result"

# A compaction announces itself here (`started`, then `progress` per summary
# piece); how it ended goes to the result.
COMPACTION_EVENT = "compaction.event"

# Query submission: captured by the QUERIES work-queue stream.
QUERY_PREFIX = "chat.query"
# Replies and streamed tokens to the caller, plain core NATS.
REPLY_PREFIX = "chat.reply"
TOKEN_PREFIX = "chat.token"
# Stop a session's answer: a core NATS request every generator listens to;
# the one running the session's answer stops it and replies.
STOP_PREFIX = "chat.stop"
# Generator state transitions, one subject per session, last one kept in a stream.
STATE_PREFIX = "generator.state"
# Tools answer NATS requests on `tool.call.<name>`, and list themselves on `tool.list`.
TOOL_PREFIX = "tool.call"
TOOL_LIST = "tool.list"
# Each process answers `<service>.status` (`service_status`) with what it is doing.
STATUS_SUFFIX = "status"
# A session was deleted (by a gateway): the pages showing it close it.
SESSION_DELETED_PREFIX = "session.deleted"
# Malformed input on event subjects is reported here (requests get a reply).
ERROR_SUBJECT = "system.error"
# All of the above, as few wildcards as cover them: what a tail of the bus
# (scripts/watch.py) listens to. Not the streams' own `history.*` writes.
SYSTEM_SUBJECTS = ("chat.>", f"{STATE_PREFIX}.>", RESPONSE_GENERATION, "compaction.>",
                   "tool.>", f"{SESSION_DELETED_PREFIX}.>", ERROR_SUBJECT)

# JetStream streams.
QUERIES_STREAM = "QUERIES"
COMPACTIONS_STREAM = "COMPACTIONS"
GENERATIONS_STREAM = "GENERATIONS"
HISTORY_STREAM = "HISTORY"
STATE_STREAM = "GENERATOR_STATE"
# Compaction results kept, so a decider that was away still hears its answer.
RESULTS_STREAM = "COMPACTION_RESULTS"
HISTORY_PREFIX = "history"

# JetStream key-value buckets.
SESSIONS_BUCKET = "sessions"
LOCKS_BUCKET = "session_locks"
# Each session's compactions in flight, whichever generator runs them.
COMPACTIONS_RUNNING_BUCKET = "compactions_running"
# Settings that change while the services run (`nats kv put config <name> <value>`).
CONFIG_BUCKET = "config"
# Error replies by query id, for as long as a resend of the query is dropped as a duplicate.
QUERY_ERRORS_BUCKET = "query_errors"

# Safe as one subject token and as a KV key (messages validate against it too).
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_TOOL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class InvalidSubjectToken(ValueError):
    pass


def session_id(value: str) -> str:
    """Return `value` if it is safe as one subject token and KV key, else raise."""
    if not _SESSION_ID.fullmatch(value):
        raise InvalidSubjectToken(
            "session id must be 1-64 characters of letters, digits, '-' or '_'"
        )
    return value


def is_valid_session_id(value: str) -> bool:
    return _SESSION_ID.fullmatch(value) is not None


# Subjects whose last token is a session id.
PER_SESSION_PREFIXES = (QUERY_PREFIX, REPLY_PREFIX, TOKEN_PREFIX, STOP_PREFIX, STATE_PREFIX,
                        HISTORY_PREFIX, SESSION_DELETED_PREFIX)


def session_in(subject: str) -> str | None:
    """The session a per-session subject names, else None."""
    prefix, _, last = subject.rpartition(".")
    return last if prefix in PER_SESSION_PREFIXES else None


def query(sid: str) -> str:
    return f"{QUERY_PREFIX}.{session_id(sid)}"


def reply(sid: str) -> str:
    return f"{REPLY_PREFIX}.{session_id(sid)}"


def token(sid: str) -> str:
    return f"{TOKEN_PREFIX}.{session_id(sid)}"


def stop(sid: str) -> str:
    return f"{STOP_PREFIX}.{session_id(sid)}"


def state(sid: str) -> str:
    return f"{STATE_PREFIX}.{session_id(sid)}"


def session_deleted(sid: str) -> str:
    return f"{SESSION_DELETED_PREFIX}.{session_id(sid)}"


def history(sid: str) -> str:
    return f"{HISTORY_PREFIX}.{session_id(sid)}"


def tool(name: str) -> str:
    if not _TOOL_NAME.fullmatch(name):
        raise InvalidSubjectToken("tool name must be lower-case letters, digits or '_'")
    return f"{TOOL_PREFIX}.{name}"



def service_status(service: str) -> str:
    """Where the process named `service` ("generator", "gateway", ...) answers
    a status request."""
    return f"{service}.{STATUS_SUFFIX}"
