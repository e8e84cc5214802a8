"""The live settings as the gateway follows them. Only the gauge's mark of
where automatic compaction begins depends on them, so a watch that NATS
refuses (a users file from before the gateway read them) or that fails on a
reconnect is tried again in the background until it takes: never a reason
to refuse to serve, nor to show a stale mark for good."""

from __future__ import annotations

import asyncio

import structlog

from services.gateway.settings import GatewaySettings
from services.shared.live_config import LiveSettings
from services.shared.reconnects import cancel_until_done, until_done

RETRY_FIRST_S = 1.0
RETRY_MOST_S = 30.0
log = structlog.get_logger()


class SettingsWatch:
    def __init__(self, tuning: LiveSettings[GatewaySettings]) -> None:
        self._tuning = tuning
        self._task: asyncio.Task[None] | None = None

    async def restart(self) -> None:
        """Watch the bucket anew, in the background, until the watch takes.
        A try still under way ends first: two at once could leave a watch
        of the first behind, which nothing would stop."""
        if self._task is not None:
            await cancel_until_done(self._task)
        self._task = asyncio.create_task(self._until_watched())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_until_done(self._task)
        await self._tuning.stop()

    async def _until_watched(self) -> None:
        # watch_again, not start: a failed try may have left half a watch.
        if await until_done(self._tuning.watch_again, "live_settings_unwatched",
                            RETRY_FIRST_S, RETRY_MOST_S):
            log.info("live_settings_watched")
