"""The JetStream layout: every stream and bucket the services rely on.

The services but the tools (which only read history) call `ensure_layout`
at start and again each time NATS comes back (a memory stream never
survives a restart, a lost store keeps nothing); creating what exists
already is a no-op, so any of them can start first.
Nothing is ever recreated or purged here: an operator's changes to a stream's
limits survive restarts. The one exception is the number of replicas
(`JETSTREAM_REPLICAS`): the generator moves every stream of the layout and
every bucket to it, since a cluster grown from one node to three should not
keep its history on one of them.

A stream that is missing holds nothing yet: readers take it so (`missing`)
rather than fail, until the layout is made again.
"""

from __future__ import annotations

import structlog
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RawStreamMsg,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import APIError, NotFoundError
from nats.js.errors import Error as JetStreamError
from nats.js.kv import KeyValue

from schemas import subjects as s

log = structlog.get_logger()

DUPLICATE_WINDOW_S = 120.0
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# The default `LOCK_LEASE_S` of the generator, and of a lock bucket another service makes first.
DEFAULT_LOCK_LEASE_S = 5.0
# "Stream name already in use with a different configuration": another
# service made it first (NATS came back, every service makes sure at once).
NAME_IN_USE = 10058

STREAMS = (
    StreamConfig(
        name=s.QUERIES_STREAM,
        description="User queries waiting for a generator (work queue)",
        subjects=[f"{s.QUERY_PREFIX}.*"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        allow_direct=True,
    ),
    StreamConfig(
        name=s.COMPACTIONS_STREAM,
        description="Compaction requests waiting for a generator (work queue)",
        subjects=[s.COMPACTION_REQUEST],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
    ),
    StreamConfig(
        name=s.GENERATIONS_STREAM,
        description="Finished generations, replayed by the compaction decider",
        subjects=[s.RESPONSE_GENERATION],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=7 * 24 * 3600.0,
        duplicate_window=DUPLICATE_WINDOW_S,
    ),
    StreamConfig(
        name=s.HISTORY_STREAM,
        description="Chat history: one subject per session, its transcript and context",
        subjects=[f"{s.HISTORY_PREFIX}.*"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        # No rollups: a Nats-Rollup header would purge a session's transcript,
        # which only an explicit delete may do.
        allow_rollup_hdrs=False,
        allow_direct=True,
        duplicate_window=DUPLICATE_WINDOW_S,
        max_msg_size=MAX_MESSAGE_BYTES,
    ),
    StreamConfig(
        name=s.STATE_STREAM,
        description="Each session's latest generator state",
        subjects=[f"{s.STATE_PREFIX}.*"],
        retention=RetentionPolicy.LIMITS,
        # Several writes a turn, worthless after a restart: memory, not disk.
        storage=StorageType.MEMORY,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
    ),
    # Results travel on core NATS to whoever listens; the decider reads them
    # from here instead, so one published while it was disconnected still
    # clears its pending request.
    StreamConfig(
        name=s.RESULTS_STREAM,
        description="Compaction results, read by the compaction decider",
        subjects=[s.COMPACTION_RESULT],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=24 * 3600.0,
    ),
)


class ReplicasMismatch(RuntimeError):
    """A stream or bucket of the layout cannot be moved to the replicas asked for."""


# The server refusing a write for want of room: an account's or its own limits,
# or its disk or memory full (JSAccountResourcesExceeded, JSInsufficientResources,
# JSMemoryResourcesExceeded, JSStorageResourcesExceeded in nats-server's errors).
# Account or server resources exceeded, insufficient storage, a stream's or
# bucket's own byte limit (an operator may set one) reached.
NO_ROOM_CODES = frozenset({10002, 10023, 10028, 10047, 10077})
NO_ROOM = ("NATS has no room left to store it (JetStream's limits, or its disk or memory, "
           "are full). Free space or raise the limits, then try again.")


def no_room(err: BaseException) -> bool:
    """Whether `err` is JetStream refusing a write for want of room."""
    return isinstance(err, APIError) and err.err_code in NO_ROOM_CODES


async def ensure_layout(js: JetStreamContext, lock_lease_s: float | None = None,
                        replicas: int | None = None, move_replicas: bool = False) -> None:
    """Make what is missing with `replicas` copies (the services pass
    `JETSTREAM_REPLICAS`), and with `move_replicas` give every stream and
    bucket that many and mend what earlier releases made otherwise. Only the
    generator, the layout's owner, does so and passes its lease; the others
    leave what exists as they find it."""
    found: dict[str, StreamInfo] = {}
    for config in STREAMS:
        name = config.name or ""
        try:
            found[name] = await js.stream_info(name)
        except NotFoundError:
            await _add_stream(js, config, replicas or 1)
    # Made with their copies from the first: a bucket made with one and moved
    # to three takes no writes for about 5 s while its new copies join.
    copies = replicas or 1
    await sessions_bucket(js, copies)
    await locks_bucket(js, lock_lease_s, copies)
    await compactions_running_bucket(js, copies)
    await config_bucket(js, copies)
    await query_errors_bucket(js, copies)
    if move_replicas:
        history = found.get(s.HISTORY_STREAM)
        if history is not None:  # one made just now is as it should be
            await refuse_rollups(js, history)
        if replicas is not None:
            await match_replicas(js, replicas)


async def refuse_rollups(js: JetStreamContext, info: StreamInfo) -> None:
    """Earlier releases made HISTORY allowing rollups, which nothing sent."""
    if info.config.allow_rollup_hdrs:
        info.config.allow_rollup_hdrs = False
        await js.update_stream(info.config)
        log.warning("history_rollups_refused_from_now_on")


async def _add_stream(js: JetStreamContext, config: StreamConfig, replicas: int) -> None:
    try:
        await js.add_stream(config, num_replicas=replicas)
    except APIError as err:
        if err.err_code == NAME_IN_USE:  # another service made it meanwhile
            return
        raise _cannot_make(f"stream {config.name}", replicas, err) from err


def layout_stream_names() -> set[str]:
    return {config.name or "" for config in STREAMS}


async def match_replicas(js: JetStreamContext, replicas: int) -> None:
    """Move each stream of the layout, and each bucket (a `KV_` stream; every
    bucket of this account is the services'), to `replicas` copies. Buckets are
    covered generically, so a bucket added to the layout later is too."""
    ours = layout_stream_names()
    for info in await js.streams_info():
        name = info.config.name or ""
        if not (name in ours or name.startswith("KV_")):
            continue
        was = info.config.num_replicas or 1
        if was == replicas:
            continue
        info.config.num_replicas = replicas
        try:
            await js.update_stream(info.config)
        except JetStreamError as err:
            raise ReplicasMismatch(
                f"stream {name} has {was} replicas and JETSTREAM_REPLICAS is {replicas};"
                f" changing it failed: {err}") from err
        log.warning("stream_replicas_changed", stream=name, was=was, now=replicas)


async def missing(js: JetStreamContext, stream: str) -> bool:
    """Whether the stream does not exist. A direct get from a missing stream
    is answered by nobody (`NoRespondersError`), like one sent while the
    stream's servers are away: asking tells the two apart."""
    try:
        await js.stream_info(stream)
    except NotFoundError:
        return True
    return False


async def bucket_missing(kv: KeyValue) -> bool:
    """Whether the bucket's stream does not exist (see `missing`)."""
    try:
        await kv.status()
    except NotFoundError:
        return True
    return False


# The server lists at most this many subjects in one stream info.
MAX_LISTED_KEYS = 100_000


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every key of a bucket whose last entry may be a value or a delete
    marker, read from one snapshot the server takes under the stream's lock.

    Not `KeyValue.keys()`: its replay ends on the first entry that reports
    nothing pending, and under concurrent writes that report comes early;
    against one server with four writers it gave none or only part of the
    keys in one listing of five. Past `MAX_LISTED_KEYS` the server's answer
    is cut, and so is this list (logged)."""
    prefix = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    except NotFoundError:  # not even the bucket yet
        return []
    subjects = info.state.subjects or {}
    if len(subjects) >= MAX_LISTED_KEYS:
        log.warning("bucket_listing_cut", bucket=bucket, listed=len(subjects))
    return [subject.removeprefix(prefix) for subject in subjects]


async def sessions_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    return await _bucket(js, KeyValueConfig(bucket=s.SESSIONS_BUCKET, history=1,
                                            storage=StorageType.FILE, replicas=replicas))


async def compactions_running_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    # Memory, as the states: worthless after a restart, written twice a compaction.
    return await _bucket(js, KeyValueConfig(bucket=s.COMPACTIONS_RUNNING_BUCKET, history=1,
                                            storage=StorageType.MEMORY, replicas=replicas))


async def config_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """The settings changed live (`services.shared.live_config`), with a few
    earlier values of each kept."""
    return await _bucket(js, KeyValueConfig(bucket=s.CONFIG_BUCKET, history=5,
                                            storage=StorageType.FILE, replicas=replicas))


async def query_errors_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """Error replies (`services.shared.query_errors`), each kept as long as the
    QUERIES stream drops a resend of its query."""
    return await _bucket(js, KeyValueConfig(bucket=s.QUERY_ERRORS_BUCKET, history=1,
                                            ttl=DUPLICATE_WINDOW_S, storage=StorageType.FILE,
                                            replicas=replicas))


async def locks_bucket(js: JetStreamContext, lease_s: float | None,
                       replicas: int = 1) -> KeyValue:
    """The lock bucket, its TTL set to `lease_s` when given (else, if it is
    new, to the default lease)."""
    # A bucket-wide TTL with history=1: every renewal (an update) restarts the
    # key's age, and a holder that dies stops renewing, so its lock lapses
    # within one lease. (A per-message TTL would be lost by the first update.)
    kv = await _bucket(js, KeyValueConfig(bucket=s.LOCKS_BUCKET, history=1,
                                          ttl=lease_s or DEFAULT_LOCK_LEASE_S,
                                          storage=StorageType.FILE, replicas=replicas))
    if lease_s is None:
        return kv
    info = await js.stream_info(f"KV_{s.LOCKS_BUCKET}")
    if info.config.max_age != lease_s:  # the lease setting changed: the TTL follows
        info.config.max_age = lease_s
        info.config.duplicate_window = min(info.config.duplicate_window, lease_s)
        await js.update_stream(info.config)
    return kv


async def _bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.key_value(config.bucket)
    except NotFoundError:
        pass
    try:
        return await js.create_key_value(config)
    except APIError as err:
        if err.err_code == NAME_IN_USE:  # another service made it meanwhile
            return await js.key_value(config.bucket)
        if config.replicas > 1:
            raise _cannot_make(f"bucket {config.bucket}", config.replicas, err) from err
        raise


def _cannot_make(what: str, replicas: int, err: APIError) -> ReplicasMismatch:
    return ReplicasMismatch(
        f"{what} with {replicas} replicas cannot be made: {err}"
        " (JETSTREAM_REPLICAS may not exceed the cluster's JetStream servers)")


class QueuedQueries:
    """The session's queries still in the QUERIES stream, oldest first, from
    sequence `start`: each read is the next one of the session's subject.

    An iterator, not an async generator: a caller may stop at the query it
    looks for, and an async generator left so is closed later by the event
    loop, in a task of its own; this one holds nothing to close."""

    def __init__(self, js: JetStreamContext, sid: str, direct: bool, start: int = 1) -> None:
        self._js, self._sid, self._direct, self._start = js, sid, direct, start

    def __aiter__(self) -> QueuedQueries:
        return self

    async def __anext__(self) -> RawStreamMsg:
        try:
            msg = await self._js.get_msg(s.QUERIES_STREAM, seq=self._start,
                                         subject=s.query(self._sid), next=True,
                                         direct=self._direct)
        except NotFoundError:
            raise StopAsyncIteration from None
        self._start = int(msg.seq or self._start) + 1
        return msg
