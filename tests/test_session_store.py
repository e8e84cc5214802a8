"""Listing a bucket's keys while others write to it, and writing a record
while others delete or write it, on a real nats-server.

nats-py's `KeyValue.keys()` ends early under concurrent writes (one listing
in five came back short here); the session list must not."""

from __future__ import annotations

import asyncio
import itertools
import uuid

from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig

from schemas.session import SessionRecord
from services.shared.jetstream import bucket_keys
from services.shared.sessions import SessionStore

KEYS = 100
LISTINGS = 40
WRITERS = 4


async def test_every_key_is_listed_while_others_write(nc: NATS) -> None:
    js = nc.jetstream()
    bucket = f"listing-{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1))
    names = [f"k{i}" for i in range(KEYS)]
    for name in names:
        await kv.put(name, b"first")
    done = asyncio.Event()

    async def rewrite(start: int) -> None:
        for name in itertools.cycle(names[start:] + names[:start]):
            if done.is_set():
                return
            await kv.put(name, b"again")

    writers = [asyncio.create_task(rewrite(i * KEYS // WRITERS)) for i in range(WRITERS)]
    try:
        listings = [set(await bucket_keys(js, bucket)) for _ in range(LISTINGS)]
    finally:
        done.set()
        await asyncio.gather(*writers)
        await js.delete_key_value(bucket)
    assert all(listed == set(names) for listed in listings)


async def test_a_missing_bucket_lists_nothing(nc: NATS) -> None:
    assert await bucket_keys(nc.jetstream(), f"never-{uuid.uuid4().hex[:8]}") == []


async def test_deleted_sessions_are_not_listed(nc: NATS) -> None:
    store = await SessionStore.open(nc.jetstream())
    kept, gone = SessionRecord(session_id=uuid.uuid4().hex), SessionRecord(
        session_id=uuid.uuid4().hex)
    await store.create(kept)
    await store.create(gone)
    await store.delete(gone.session_id)
    listed = {r.session_id for r in await store.newest(100_000)}
    assert kept.session_id in listed and gone.session_id not in listed


async def test_a_change_to_a_deleted_session_does_not_bring_it_back(nc: NATS) -> None:
    # A generator's calibration write that lands after the delete's purge.
    writer, deleter = [await SessionStore.open(nc.jetstream()) for _ in range(2)]
    record = SessionRecord(session_id=uuid.uuid4().hex)
    await writer.create(record)
    await writer.get(record.session_id)  # read before the delete
    await deleter.delete(record.session_id)
    changed = record.model_copy(update={"context_length": 4096})
    assert await writer.update(changed) is False
    assert not await deleter.exists(record.session_id)
    assert not await writer.exists(record.session_id)


async def test_a_change_over_another_writers_is_dropped_and_read_afresh(nc: NATS) -> None:
    first, second = [await SessionStore.open(nc.jetstream()) for _ in range(2)]
    record = SessionRecord(session_id=uuid.uuid4().hex)
    await first.create(record)
    await first.get(record.session_id)
    assert await second.update(record.model_copy(update={"context_length": 4096}))
    assert await first.update(record.model_copy(update={"context_length": 2048})) is False
    assert (await first.get(record.session_id)).context_length == 4096
    assert await first.update(record.model_copy(update={"context_length": 2048}))
    assert (await second.update(record)) is False
