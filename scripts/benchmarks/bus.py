"""The driver's NATS side: watching what turns put on the bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import nats
from nats.aio.msg import Msg

from services.shared.bus import round_trip

# How long what a turn sets off after its reply (the report, acknowledgements)
# is given to arrive once the block's last turn is answered.
FOLLOW_UPS_S = 0.2


@contextlib.asynccontextmanager
async def watching_bus(nats_url: str, subjects: Iterable[str],
                       on_message: Callable[[Msg], Awaitable[None]]) -> AsyncIterator[None]:
    """`on_message` sees every message on `subjects` sent during the block
    (subscribed before it starts), and the last turn's follow-ups."""
    nc = await nats.connect(nats_url)
    try:
        for subject in subjects:
            await nc.subscribe(subject, cb=on_message)
        await round_trip(nc)
        yield
        await asyncio.sleep(FOLLOW_UPS_S)
        await round_trip(nc)
    finally:
        await nc.close()
