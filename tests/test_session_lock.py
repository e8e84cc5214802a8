"""The durable per-session lock on a real JetStream KV bucket."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from typing import Any, cast

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas import subjects
from services.generator.session_lock import Lease, LockTimeout, SessionLocks
from services.shared.bus import round_trip
from services.shared.jetstream import ensure_layout, locks_bucket
from tests.events import eventually
from tests.nats_server import NatsServer

# Short, for the tests of expiry and renewal (renewed every second, a stall
# of two does not lose it); the others take a lease no stall of a busy
# machine outlasts, so what they see held stays held.
LEASE_S = 3.0
LONG_LEASE_S = 60.0


async def new_locks(nc: NATS, lease_s: float = LEASE_S) -> SessionLocks:
    bucket = f"locks_test_{uuid.uuid4().hex[:8]}"
    kv = await nc.jetstream().create_key_value(KeyValueConfig(
        bucket=bucket, history=1, ttl=lease_s, storage=StorageType.FILE))
    return SessionLocks(kv, "holder-a", lease_s, wait_s=0.3)


@pytest.fixture
async def locks(nc: NATS) -> SessionLocks:
    return await new_locks(nc, LONG_LEASE_S)


@pytest.fixture
async def short_locks(nc: NATS) -> SessionLocks:
    return await new_locks(nc, LEASE_S)


def other_holder(locks: SessionLocks, wait_s: float = 0.3) -> SessionLocks:
    return SessionLocks(locks._kv, "holder-b", locks._lease_s, wait_s)


async def test_one_holder_at_a_time_and_revision_is_the_fencing_token(
    locks: SessionLocks,
) -> None:
    first = await locks.acquire("s1", "query")
    with pytest.raises(LockTimeout):
        await other_holder(locks).acquire("s1", "compaction")
    await locks.release(first)
    second = await other_holder(locks).acquire("s1", "compaction")
    assert second.revision > first.revision
    await other_holder(locks).release(second)


async def test_other_sessions_are_not_blocked(locks: SessionLocks) -> None:
    held = await locks.acquire("s1", "query")
    other = await other_holder(locks).acquire("s2", "query")
    await locks.release(held)
    await other_holder(locks).release(other)


async def test_renewal_keeps_the_lock_past_its_lease(short_locks: SessionLocks) -> None:
    locks = short_locks
    async with locks.hold("s1", "query") as lease:
        taken_at = lease.revision
        # Renewed every third of a lease: three renewals outlast the first lease.
        await eventually(lambda: lease.revision >= taken_at + 3, "three renewals")
        assert not lease.lost
        with pytest.raises(LockTimeout):
            await other_holder(locks).acquire("s1", "query")
        assert await locks.purpose_of("s1") == "query"
    assert await locks.purpose_of("s1") is None


async def test_a_holder_that_stops_renewing_frees_the_session_within_a_lease(
    short_locks: SessionLocks,
) -> None:
    locks = short_locks
    await locks.acquire("s1", "query")  # never renewed, never released: a dead holder
    # The server expires keys on a timer of its own: allow a few leases under load.
    taken = await other_holder(locks, wait_s=LEASE_S * 6).acquire("s1", "query")
    assert taken.revision > 0


async def test_a_stale_holder_cannot_release_the_next_holders_lock(
        short_locks: SessionLocks) -> None:
    locks = short_locks
    stale = await locks.acquire("s1", "query")
    # Taken once the stale lease lapsed and its key expired; renewed after.
    async with other_holder(locks, wait_s=LEASE_S * 6).hold("s1", "query"):
        await locks.release(stale)  # must not delete the fresh holder's key
        assert await other_holder(locks).try_acquire("s1", "query") is None


async def test_waiters_get_the_lock_when_it_is_released(locks: SessionLocks) -> None:
    held = await locks.acquire("s1", "query")
    waiter = asyncio.create_task(other_holder(locks, wait_s=5).acquire("s1", "query"))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await locks.release(held)
    assert (await asyncio.wait_for(waiter, 5)).revision > held.revision


async def test_the_product_bucket_expires_keys_by_lease(private_nats: NatsServer) -> None:
    client = await nats.connect(private_nats.url)  # setting a lease is for a server of our own
    try:
        status = await (await locks_bucket(client.jetstream(), 5.0)).status()
    finally:
        await client.close()
    assert status.bucket == subjects.LOCKS_BUCKET
    assert status.ttl == 5.0
    assert status.history == 1


async def test_only_the_generator_sets_the_lease_of_the_lock_bucket(
        private_nats: NatsServer) -> None:
    """Another service starting after a generator with a long lease leaves that
    lease alone: were it reset to the default, locks would lapse mid-turn."""
    client = await nats.connect(private_nats.url)
    try:
        js = client.jetstream()
        await ensure_layout(js, lock_lease_s=20.0)  # a generator
        await ensure_layout(js)  # the gateway, the decider, the tools
        assert (await (await js.key_value(subjects.LOCKS_BUCKET)).status()).ttl == 20.0
        await ensure_layout(js, lock_lease_s=8.0)  # a generator with a new setting
        assert (await (await js.key_value(subjects.LOCKS_BUCKET)).status()).ttl == 8.0
    finally:
        await client.close()


async def test_try_acquire_never_waits(locks: SessionLocks) -> None:
    held = await locks.acquire("s1", "query")
    assert await other_holder(locks).try_acquire("s1", "query") is None
    await locks.release(held)
    assert await other_holder(locks).try_acquire("s1", "query") is not None


async def test_a_lock_taken_back_from_ourselves_is_resumed(locks: SessionLocks) -> None:
    """`resumed` tells the holder that nobody else held the session since its
    own release, so its cached view of the history is current."""
    first = await locks.acquire("s1", "query")
    assert not first.resumed
    await locks.release(first)
    again = await locks.acquire("s1", "query")
    assert again.resumed
    await locks.release(again)
    theirs = await other_holder(locks).acquire("s1", "query")
    assert not theirs.resumed
    await other_holder(locks).release(theirs)
    after_them = await locks.acquire("s1", "query")
    assert not after_them.resumed  # our free marker is gone: they held it meanwhile
    await locks.release(after_them)


async def test_a_renewal_in_flight_when_the_holder_finishes_does_not_strand_the_lock(
    private_nats: NatsServer,
) -> None:
    """The renewal is sent to a server that is not answering (SIGSTOP) and the
    holder finishes meanwhile. Cancelling that renewal would lose its new
    revision while the server still stores it; the release would then be
    refused and the session stay locked for a whole lease."""
    client = await nats.connect(private_nats.url)
    try:
        locks = await new_locks(client, LEASE_S)
        leases: list[Lease] = []
        finish = asyncio.Event()

        async def hold_until_told() -> None:
            async with locks.hold("s1", "query") as lease:
                leases.append(lease)
                await finish.wait()

        holder = asyncio.create_task(hold_until_told())
        await eventually(lambda: bool(leases), "the lock held")
        private_nats.signal(signal.SIGSTOP)
        try:
            await eventually(lambda: leases[0].renewing, "a renewal sent, not answered")
            finish.set()
            await eventually(lambda: not leases[0].held, "the holder done, its renewal out")
        finally:
            private_nats.signal(signal.SIGCONT)
        await asyncio.wait_for(holder, 10)
        assert await locks.purpose_of("s1") is None  # released, not stranded
        taken = await other_holder(locks).try_acquire("s1", "query")
        assert taken is not None
    finally:
        await client.close()


async def test_a_lease_given_back_unused_after_someone_else_held_it_is_not_resumed(
        locks: SessionLocks) -> None:
    """We take over another holder's marker but give the lease back without
    reading the history (an earlier query still waits): our view never took in
    their writes, so the next lease must send us to the server."""
    theirs = await other_holder(locks).acquire("s1", "query")
    await other_holder(locks).release(theirs)
    unused = await locks.try_acquire("s1", "query")
    assert unused is not None and not unused.resumed
    await locks.release(unused, used=False)
    again = await locks.try_acquire("s1", "query")
    assert again is not None and not again.resumed
    await locks.release(again)
    resumed = await locks.acquire("s1", "query")
    assert resumed.resumed  # a lease that was used is resumable
    await locks.release(resumed)


async def test_a_release_the_server_does_not_answer_leaves_the_blocks_outcome(
        private_nats: NatsServer) -> None:
    """The work under the lock is done (a reply sent); the release then gets no
    answer. The block's result stands, and the lock lapses by itself."""
    client = await nats.connect(private_nats.url)
    try:
        js = client.jetstream(timeout=0.5)
        kv = await js.create_key_value(KeyValueConfig(bucket="locks_unanswered", history=1,
                                                      ttl=LEASE_S, storage=StorageType.FILE))
        locks = SessionLocks(kv, "holder-a", LEASE_S, wait_s=0.3)
        async with locks.hold("s1", "query"):
            private_nats.signal(signal.SIGSTOP)  # the work is done; the release is not answered
        # Nothing raised out of the block: its outcome stands.
    finally:
        private_nats.signal(signal.SIGCONT)
        await client.close()


async def test_a_taker_finds_where_the_history_stood_at_the_release(locks: SessionLocks) -> None:
    """A holder that knows where the session's history stands leaves it in its
    free marker, and whoever takes the session over finds it there; a holder
    that does not say (a compaction, a lease given back unused) leaves nothing.
    A marker in the older form, without it, is free all the same."""
    theirs = await other_holder(locks).acquire("s1", "query")
    theirs.leaves_history_at = 42
    await other_holder(locks).release(theirs)
    assert await locks.purpose_of("s1") is None  # a marker, not a holder
    ours = await locks.acquire("s1", "query")
    assert not ours.resumed and ours.found_history_at == 42
    await locks.release(ours)
    after_us = await other_holder(locks).acquire("s1", "query")
    assert after_us.found_history_at is None
    await other_holder(locks).release(after_us)

    await locks._kv.put("s2", b'{"free": true}')
    older = await locks.try_acquire("s2", "query")
    assert older is not None and older.found_history_at is None
    await locks.release(older)


async def test_a_release_someone_else_replaced_is_not_tried_again(
        locks: SessionLocks, nc: NATS) -> None:
    """Told that another process wrote the session since our release, the next
    take goes straight to a take-over (a create, then the swap on their marker)
    instead of first trying to swap our own marker, which is surely gone."""

    async def writes_to_take(sid: str, forget: bool) -> int:
        ours = await locks.acquire(sid, "query")
        await locks.release(ours)
        theirs = await other_holder(locks).acquire(sid, "query")
        await other_holder(locks).release(theirs)
        if forget:
            locks.forget_release(sid)
        seen = await nc.subscribe(f"$KV.{locks._kv._name}.{sid}")
        await round_trip(nc)
        taken = await locks.acquire(sid, "query")
        await round_trip(nc)
        writes = seen.pending_msgs
        await seen.unsubscribe()
        await locks.release(taken)
        return writes

    assert await writes_to_take("told", forget=True) == 2
    assert await writes_to_take("not-told", forget=False) == 3


class AnswerLost:
    """The bucket, but the server's answer to one update is lost after the
    update was stored: what a timeout on a slow or reconnecting NATS does."""

    def __init__(self, kv: KeyValue, lost: set[int]) -> None:
        self._kv = kv
        self._lost = lost  # which updates, counted from 1
        self.updates = 0
        self.updated = asyncio.Event()

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        self.updates += 1
        self.updated.set()
        if self.updates not in self._lost:
            return await self._kv.update(key, value, last=last)
        with contextlib.suppress(KeyWrongLastSequenceError):  # its answer is lost either way
            await self._kv.update(key, value, last=last)
        raise TimeoutError("no answer")

    async def until_updates(self, count: int) -> None:
        while self.updates < count:
            self.updated.clear()
            await self.updated.wait()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


# The first renewal's answer, the second's, or both (the second then refused
# over the revision the first made, unanswered too).
@pytest.mark.parametrize("lost", [{2}, {3}, {2, 3}])
async def test_a_renewal_stored_with_its_answer_lost_keeps_the_lease(
        nc: NATS, lost: set[int]) -> None:
    """The next renewal was refused over the revision it did not know, and
    the lease was taken for lost: it stopped renewing and the key lapsed
    under a turn still running. The key is read back instead: it holds our
    renewal, whose revision the lease takes."""
    kv = AnswerLost((await new_locks(nc))._kv, lost)  # 1: the take; then renewals
    locks = SessionLocks(cast(KeyValue, kv), "holder-a", LEASE_S, wait_s=0.3)
    async with locks.hold("s1", "query") as lease:
        await asyncio.wait_for(kv.until_updates(max(lost) + 2), 60)  # two renewals after
        assert not lease.lost
        assert await other_holder(locks).try_acquire("s1", "query") is None
    assert await locks.purpose_of("s1") is None  # released over the revision found


async def test_a_release_after_a_renewal_whose_answer_was_lost_frees_the_session(
        nc: NATS) -> None:
    kv = AnswerLost((await new_locks(nc))._kv, {2})
    locks = SessionLocks(cast(KeyValue, kv), "holder-a", LEASE_S, wait_s=0.3)
    async with locks.hold("s1", "query"):
        await asyncio.wait_for(kv.until_updates(2), 60)  # the renewal, stored, unanswered
    assert await locks.purpose_of("s1") is None  # not left locked for a lease


async def test_a_take_whose_answer_was_lost_is_adopted_by_its_own_process_only(
        locks: SessionLocks) -> None:
    """A take sent while NATS was away goes out when it is back, its answer to
    nobody: the process finds it its own. A replica with the same GENERATOR_ID
    does not, and the adopted lease runs from its adoption."""
    lost = await locks.try_acquire("s1", "compaction")  # as if its answer never came
    assert lost is not None
    twin = SessionLocks(locks._kv, "holder-a", locks._lease_s, wait_s=0.3)  # same id
    assert await twin.taken_unanswered("s1", "compaction") is None
    assert await locks.taken_unanswered("s1", "query") is None  # not for another purpose
    adopted = await locks.taken_unanswered("s1", "compaction")
    assert adopted is not None and adopted.revision > lost.revision
    await locks.release(adopted)
    assert await locks.purpose_of("s1") is None
