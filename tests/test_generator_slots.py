"""The generator's `MAX_CONCURRENT_SESSIONS` slots, with the generator built in
this process on a server of the test's own and the Ollama stand-in."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg

from schemas import subjects
from schemas.messages import Query
from schemas.session import SessionRecord
from services.generator.service import build
from services.generator.settings import GeneratorSettings
from services.shared.bus import Bus
from services.shared.jetstream import ensure_layout, sessions_bucket
from services.shared.sessions import SessionStore
from tests.nats_server import NatsServer


async def test_a_query_gives_its_slot_back_as_its_reply_goes_out(
        private_nats: NatsServer, stub_url: str) -> None:
    """The lock's release comes after the reply; with every slot taken, the
    session's next query must not wait for that release to be pulled."""
    nc = await nats.connect(private_nats.url)
    bus = Bus(nc, "generator")
    await ensure_layout(bus.js)
    generator = await build(bus, GeneratorSettings(
        ollama_host=stub_url, model="stub-model", max_concurrent_sessions=1))
    await generator.start()
    try:
        sessions = SessionStore(await sessions_bucket(bus.js))
        await sessions.create(SessionRecord(session_id="slots"))
        free_at_reply: asyncio.Queue[int] = asyncio.Queue()

        async def on_reply(_msg: Msg) -> None:
            free_at_reply.put_nowait(generator.status()["free_slots"])

        await nc.subscribe(subjects.reply("slots"), cb=on_reply)
        for question in ("first", "second"):
            await bus.js_publish(subjects.query("slots"),
                                 Query(session_id="slots", content=question),
                                 session_id="slots")
            assert await asyncio.wait_for(free_at_reply.get(), 10) == 1
    finally:
        await generator.stop()
        await nc.close()
