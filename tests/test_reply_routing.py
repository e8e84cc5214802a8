"""The gateway's reply router on a real NATS: a reply reaches the request
that waits for its query, in that query's session only."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from schemas import subjects
from schemas.messages import Reply
from services.gateway.replies import ReplyRouter
from services.shared.bus import Bus
from services.shared.history_store import HistoryStore
from services.shared.jetstream import ensure_layout
from services.shared.query_errors import QueryErrors


async def test_another_sessions_reply_with_the_same_query_id_is_not_ours(nc: NATS) -> None:
    await ensure_layout(nc.jetstream())
    bus = Bus(nc, "gateway")
    router = ReplyRouter(bus, HistoryStore(bus.js), QueryErrors(bus.js))
    await router.start()
    try:
        with router.expect("mine", "q-shared") as waiting:
            await bus.publish(subjects.reply("theirs"), Reply(
                session_id="theirs", query_id="q-shared", reply="not for you"))
            await bus.publish(subjects.reply("mine"), Reply(
                session_id="mine", query_id="q-shared", reply="yours"))
            first = await waiting.events.get()
        assert isinstance(first, Reply) and first.reply == "yours"
    finally:
        await router.stop()
