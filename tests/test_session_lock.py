"""The durable per-session lock on a real JetStream KV bucket."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.aio.client import Client as NATS

from schemas import subjects
from services.generator.session_lock import LockTimeout, SessionLocks
from services.shared.jetstream import locks_bucket

LEASE_S = 1.0


@pytest.fixture
async def locks(nc: NATS) -> SessionLocks:
    js = nc.jetstream()
    bucket = f"locks_test_{uuid.uuid4().hex[:8]}"
    from nats.js.api import KeyValueConfig, StorageType

    kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=LEASE_S,
                                                  storage=StorageType.FILE))
    return SessionLocks(kv, "holder-a", LEASE_S, wait_s=0.3)


def other_holder(locks: SessionLocks, wait_s: float = 0.3) -> SessionLocks:
    return SessionLocks(locks._kv, "holder-b", LEASE_S, wait_s)


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


async def test_renewal_keeps_the_lock_past_its_lease(locks: SessionLocks) -> None:
    async with locks.hold("s1", "query") as lease:
        await asyncio.sleep(LEASE_S * 2.5)
        assert not lease.lost
        with pytest.raises(LockTimeout):
            await other_holder(locks).acquire("s1", "query")
        assert await locks.purpose_of("s1") == "query"
    assert await locks.purpose_of("s1") is None


async def test_a_holder_that_stops_renewing_frees_the_session_within_a_lease(
    locks: SessionLocks,
) -> None:
    await locks.acquire("s1", "query")  # never renewed, never released: a dead holder
    # The server expires keys on a timer of its own: allow a few leases under load.
    taken = await other_holder(locks, wait_s=LEASE_S * 6).acquire("s1", "query")
    assert taken.revision > 0


async def test_a_stale_holder_cannot_release_the_next_holders_lock(locks: SessionLocks) -> None:
    stale = await locks.acquire("s1", "query")
    await asyncio.sleep(LEASE_S * 1.5)  # lease lapses; the key expires
    fresh = await other_holder(locks, wait_s=LEASE_S * 6).acquire("s1", "query")
    await locks.release(stale)  # must not delete the fresh holder's key
    with pytest.raises(LockTimeout):
        await other_holder(locks).acquire("s1", "query")
    await other_holder(locks).release(fresh)


async def test_waiters_get_the_lock_when_it_is_released(locks: SessionLocks) -> None:
    held = await locks.acquire("s1", "query")
    waiter = asyncio.create_task(other_holder(locks, wait_s=5).acquire("s1", "query"))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await locks.release(held)
    assert (await asyncio.wait_for(waiter, 5)).revision > held.revision


async def test_the_product_bucket_expires_keys_by_lease(nc: NATS) -> None:
    kv = await locks_bucket(nc.jetstream(), 5.0)
    status = await kv.status()
    assert status.bucket == subjects.LOCKS_BUCKET
    assert status.ttl == 5.0
    assert status.history == 1
