"""Error replies kept for a query's duplicate window, on a real NATS."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from schemas.messages import Reply
from services.shared.jetstream import ensure_layout
from services.shared.query_errors import QueryErrors


async def test_an_id_no_bucket_key_may_spell_still_has_its_error_kept(nc: NATS) -> None:
    """Any 1-128 characters make a message id: `q:1` or `a..b` crashed the
    read on every redelivery of their query, and their errors were dropped."""
    js = nc.jetstream()
    await ensure_layout(js)
    errors = QueryErrors(js)
    for query_id in ("q:1", "a..b", "ünï cödé", ".x", "plain-id_1.2"):
        reply = Reply(session_id="s1", query_id=query_id, error_code="provider_error",
                      error="the model failed")
        await errors.keep(reply, "hi")
        assert await errors.reply_of(query_id) == reply, query_id
    assert await errors.of("never-kept") is None
