"""The durable per-session lock: one key per session in the `session_locks`
KV bucket.

Acquire is a create (a write expecting the key to have no revision yet) or
a compare-and-swap `update` over a "free" marker; the revision it returns is
the fencing token. The holder renews by compare-and-swap `update` on that
revision; the bucket's TTL (history 1) restarts the key's age on every
renewal, so a holder that dies (SIGKILL) stops renewing and the session frees
itself within one lease. Release writes the free marker by compare-and-swap
(a holder whose lease lapsed cannot free the next holder's lock) and
remembers its revision, so this process takes the session again in one round
trip; the marker itself expires with the lease. A holder that knows where the
session's history stands when it lets go says so in the marker, so that a
process taking the session over can trust a view it already follows to that
point instead of reading the history again. A process that learns someone
else has written the session since its release forgets its marker's revision:
the marker has been replaced, and trying to resume from it would only fail.

The lock only prevents duplicate work. A holder frozen past its lease
(SIGSTOP, a long GC) may wake up believing it still holds the lock; what
keeps it from corrupting history is the compare-and-swap on the history
stream itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import structlog
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from services.shared import metrics
from services.shared.bus import parse_json
from services.shared.history_store import WRONG_LAST_SEQUENCE
from services.shared.recent import Recent
from services.shared.together import together

Purpose = Literal["query", "compaction"]
MAX_REMEMBERED = 10_000
# A waiter polls with backoff up to this: short, since sessions change hands
# between processes all the time and a turn is often only milliseconds.
MAX_POLL_S = 0.025
log = structlog.get_logger()


class LockTimeout(Exception):
    """The session stayed locked by someone else for longer than we may wait."""


def free_marker(history_seq: int | None = None) -> bytes:
    """What a released lock holds: free, and where the session's history
    stood then when the holder knew it."""
    marker: dict[str, object] = {"free": True}
    if history_seq is not None:
        marker["history"] = history_seq
    return json.dumps(marker).encode()


@dataclass(frozen=True)
class FreeMarker:
    """A released lock: where the session's history stood, if its holder said."""

    history_seq: int | None


def free_marker_of(value: bytes | None) -> FreeMarker | None:
    """The free marker `value` holds, or None when it is a holder's."""
    try:
        marker = parse_json(value or b"")
    except ValueError:
        return None
    if not isinstance(marker, dict) or marker.get("free") is not True:
        return None
    seq = marker.get("history")
    known = isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0
    return FreeMarker(seq if known else None)


@dataclass
class Lease:
    session_id: str
    purpose: Purpose
    revision: int
    # Taken over this process's own free marker: nobody else has held the
    # session since we let it go, so what we know of its history is current.
    resumed: bool = False
    # Where the previous holder's marker says the history stood (None: unsaid).
    found_history_at: int | None = None
    # Set by a holder that knows where the history stands as it lets go,
    # for its marker; a holder that may have written without knowing the
    # outcome leaves it None.
    leaves_history_at: int | None = None
    lost: bool = field(default=False)
    # A renewal is on its way to the server.
    renewing: bool = field(default=False)
    # Until the holder's block ends; a renewal under way then is the last.
    held: bool = field(default=True)
    # Renewals sent without an answer (a timeout, NATS away) since the last
    # answered one: each may be stored all the same, its revision the lease's.
    unanswered: list[bytes] = field(default_factory=list)


class SessionLocks:
    def __init__(self, kv: KeyValue, holder_id: str, lease_s: float, wait_s: float) -> None:
        self._kv = kv
        self._holder = holder_id
        # This process's own mark in its lock values: GENERATOR_ID may be set
        # alike for several (a scaled compose service), or outlive a process.
        self._instance = secrets.token_hex(8)
        self._lease_s = lease_s
        self._wait_s = wait_s
        # Revision of the free marker this process wrote, per session.
        self._freed_at: Recent[str, int] = Recent(MAX_REMEMBERED)

    @contextlib.asynccontextmanager
    async def hold(self, sid: str, purpose: Purpose, wait_s: float | None = None,
                   taken: Lease | None = None) -> AsyncIterator[Lease]:
        """Hold the session's lock, renewed, for the block; `taken` is a lease
        already won by `try_acquire`."""
        lease = taken or await self.acquire(sid, purpose, wait_s)
        renewer = asyncio.create_task(self._keep_renewed(lease))
        try:
            yield lease
        finally:
            lease.held = False
            if lease.renewing:
                # Waited for, not cancelled: a renewal cut off in flight may be
                # stored while its new revision is lost, and the release would
                # then fail and leave the session locked for a whole lease.
                await renewer
            else:
                # Idle, so nothing of it can reach the server. Not waiting for
                # it sends the release in the same pass as what the holder
                # published last (a reply): the session's next query, maybe
                # on another generator, then finds the session free.
                renewer.cancel()
            try:
                await self.release(lease)
            except Exception as err:
                # The block's own outcome stands (a reply already sent, a splice
                # already made); an unreleased lock lapses within one lease.
                log.warning("lock_release_failed", session_id=sid, purpose=purpose,
                            error=f"{type(err).__name__}: {err}")

    async def acquire(self, sid: str, purpose: Purpose, wait_s: float | None = None) -> Lease:
        """Wait for the session's lock. The first attempt comes at once, even
        right after a failed `try_acquire`: a session moving to another
        generator is usually freed a moment after its reply, and waiting first
        lowered the two-generator throughput in `scripts/bench.py`."""
        wait_s = self._wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        delay = 0.005
        while True:
            lease = await self.try_acquire(sid, purpose)
            if lease is not None:
                return lease
            if time.monotonic() >= deadline:
                raise LockTimeout(f"session {sid} stayed locked for {wait_s:g} s")
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, MAX_POLL_S)

    async def try_acquire(self, sid: str, purpose: Purpose) -> Lease | None:
        """The lease if the session is free right now, else None; never waits."""
        value = self._value(purpose)
        freed_at = self._freed_at.pop(sid)
        if freed_at is not None:
            with contextlib.suppress(KeyWrongLastSequenceError):
                revision = await self._kv.update(sid, value, last=freed_at)
                return self._won(sid, purpose, revision, resumed=True)
        taken = await self._take_over(sid, value)
        if taken is None:
            return None
        revision, found = taken
        return self._won(sid, purpose, revision, resumed=False, found_history_at=found)

    def forget_release(self, sid: str) -> None:
        """Someone else has written the session since this process let it go:
        its marker was replaced, so the next take starts with a take-over."""
        self._freed_at.pop(sid)

    def _won(self, sid: str, purpose: Purpose, revision: int, resumed: bool,
             found_history_at: int | None = None) -> Lease:
        log.debug("lock_acquired", session_id=sid, purpose=purpose, revision=revision,
                  resumed=resumed)
        return Lease(sid, purpose, revision, resumed, found_history_at)

    async def _take_over(self, sid: str, value: bytes) -> tuple[int, int | None] | None:
        """Create the key, or replace someone else's free marker: the new
        revision and where the marker says the history stood, or None when
        the session is held. The create and the look-up go out together: a
        session passing between processes costs a round trip less, and one
        idle long enough for its key to expire pays for a look-up it did not
        need."""
        created, entry = await together(self._kv.update(sid, value, last=0), self._kv.get(sid))
        if isinstance(created, int):
            return created, None
        if not isinstance(created, KeyWrongLastSequenceError):
            raise created
        if isinstance(entry, KeyNotFoundError):
            return None  # the marker expired after the create: free by now, not taken
        if isinstance(entry, Exception):
            raise entry
        marker = free_marker_of(entry.value)
        if marker is None or entry.revision is None:
            return None
        with contextlib.suppress(KeyWrongLastSequenceError):
            revision = await self._kv.update(sid, value, last=entry.revision)
            metrics.generator().lock_takeovers.inc()
            return revision, marker.history_seq
        return None

    async def taken_unanswered(self, sid: str, purpose: Purpose) -> Lease | None:
        """The session's lock if this holder took it for `purpose` without
        hearing so: a take sent while NATS was away goes out when it is back,
        and its answer to nobody. For a purpose this process holds a session
        for once at a time only (a background compaction)."""
        try:
            entry = await self._kv.get(sid)
        except KeyNotFoundError:
            return None
        held = parse_json(entry.value or b"{}")
        if (not isinstance(held, dict) or held.get("instance") != self._instance
                or held.get("purpose") != purpose or entry.revision is None):
            return None
        # Written afresh: the take may have landed a lease ago, near its expiry,
        # and the revision it is taken at is then one the server answered.
        with contextlib.suppress(KeyWrongLastSequenceError):
            revision = await self._kv.update(sid, self._value(purpose), last=entry.revision)
            return self._won(sid, purpose, revision, resumed=False)
        return None

    async def purpose_of(self, sid: str) -> str | None:
        """Why the session is locked right now (None when it is free)."""
        try:
            entry = await self._kv.get(sid)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        purpose = parse_json(entry.value).get("purpose")  # a free marker names none
        return str(purpose) if purpose else None

    async def release(self, lease: Lease, used: bool = True) -> None:
        """Free the session. A lease won from someone else's marker and given
        back `used=False` (the history was never read under it) leaves no
        marker of ours to resume from: our view was never brought up to their
        writes, so taking the session back must not count as resumed."""
        try:
            freed_at = await self._kv.update(lease.session_id,
                                             free_marker(lease.leaves_history_at),
                                             last=lease.revision)
        except APIError as err:
            lapsed = isinstance(err, KeyWrongLastSequenceError)
            if not (lapsed or err.err_code in WRONG_LAST_SEQUENCE):
                raise
            if await self._answer_found(lease):
                return await self.release(lease, used)
            # Our lease lapsed and the key expired or changed hands: not ours to delete.
            log.warning("lock_release_skipped", session_id=lease.session_id,
                        revision=lease.revision)
            return
        if not (used or lease.resumed):
            return
        self._freed_at.put(lease.session_id, freed_at)

    async def _keep_renewed(self, lease: Lease) -> None:
        # Cancelled while it sleeps, once the holder is done: a plain sleep,
        # not a wait on an event with a timeout (two tasks more a turn).
        while lease.held:
            await asyncio.sleep(self._lease_s / 3)
            if not lease.held:
                return
            lease.renewing = True
            try:
                if not await self._renew(lease):
                    lease.lost = True
                    log.error("lock_lost", session_id=lease.session_id, purpose=lease.purpose)
                    return
            except Exception as err:  # the key not read back: settled next period
                log.warning("lock_renewal_failed", session_id=lease.session_id, error=str(err))
            finally:
                lease.renewing = False

    async def _renew(self, lease: Lease) -> bool:
        """One renewal; False when the lease is lost to someone else."""
        value = self._value(lease.purpose)
        try:
            lease.revision = await self._kv.update(lease.session_id, value, last=lease.revision)
        except KeyWrongLastSequenceError:
            # Lost, unless the key holds a renewal of ours whose answer was lost.
            return await self._answer_found(lease) and await self._renew(lease)
        except Exception as err:  # NATS briefly away: try again next period
            lease.unanswered.append(value)
            log.warning("lock_renewal_failed", session_id=lease.session_id, error=str(err))
        else:
            lease.unanswered.clear()
        return True

    async def _answer_found(self, lease: Lease) -> bool:
        """Whether the key holds a renewal that went unanswered: then its
        revision is the lease's."""
        if not lease.unanswered:
            return False
        try:
            entry = await self._kv.get(lease.session_id)
        except KeyNotFoundError:
            return False
        if entry.value not in lease.unanswered or entry.revision is None:
            return False
        lease.revision = entry.revision
        lease.unanswered.clear()
        log.info("lock_renewal_found_stored", session_id=lease.session_id)
        return True

    def _value(self, purpose: Purpose) -> bytes:
        return json.dumps(
            {"holder": self._holder, "instance": self._instance, "purpose": purpose,
             "since": time.time()}
        ).encode()
