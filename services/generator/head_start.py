"""A turn's first model call, sent the moment its query arrives.

Before a turn may call the model it needs the session's lock and the check
that no earlier query of the session is waiting: a round trip, and under load
many passes of the event loop. When this process knows the session's history
and record (it has read, written or followed them, and knows of no later
write), it sends the first model call at once, on that history, and asks
for the lock meanwhile.

The turn keeps the call only if, with the lock held, the history it reads
ends at the same sequence as the view the call was built on (what a subject
holds up to a sequence never changes), and the record yields the same
prompt. Otherwise the call is cancelled and its streamed tokens, held back
until then, are dropped unseen. Whatever happens, history is written only
under the lock, by compare-and-swap, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from schemas.session import SessionRecord
from services.generator.provider import ChatResult
from services.generator.stops import StopSwitch
from services.generator.token_stream import TokenStream
from services.generator.turn import WeighedPrompt
from services.shared import metrics
from services.shared.history_store import HistoryView

log = structlog.get_logger()
Messages = list[dict[str, Any]]


@dataclass
class HeadStartCount:
    """How many head starts this process kept and how many it threw away."""

    kept: int = 0
    abandoned: int = 0


@dataclass
class HeadStart:
    """One head start: what its call was built on, and the call itself."""

    view: HistoryView
    record: SessionRecord
    prompt: WeighedPrompt
    tools: Messages
    stream: TokenStream | None
    call: asyncio.Task[ChatResult]
    count: HeadStartCount
    # The call's stop switch, which the turn takes over when it keeps the call.
    switch: StopSwitch = field(default_factory=lambda: StopSwitch(""))
    settled: bool = field(default=False)

    async def result(self) -> ChatResult:
        """Keep the call: its held tokens go out, then its answer comes."""
        self._settle(kept=True)
        if self.stream is not None:
            await self.stream.release()
        return await self.call

    def abandon(self) -> None:
        """Cancel the call if it still runs; counted as abandoned unless it was kept."""
        if not self.settled:
            self._settle(kept=False)
            log.info("head_start_abandoned")
        self.call.cancel()
        if self.call.done() and not self.call.cancelled():
            with contextlib.suppress(BaseException):
                self.call.exception()  # retrieved, so asyncio does not warn of it

    def _settle(self, kept: bool) -> None:
        self.settled = True
        metrics.generator().head_starts.labels("kept" if kept else "abandoned").inc()
        if kept:
            self.count.kept += 1
        else:
            self.count.abandoned += 1


def still_good(head_view: HistoryView, head_record: SessionRecord, view: HistoryView,
               record: SessionRecord, fits_now: Callable[[], bool]) -> bool:
    """Whether a head start built on (`head_view`, `head_record`) sent the
    prompt a turn with the lock, reading (`view`, `record`), would send."""
    if head_view.last_seq != view.last_seq:
        return False  # the history moved: another writer, a compaction
    if head_record is record:
        return True
    # Re-read meanwhile (a recalibration): the same prompt if the same system
    # prompt and model, but the new estimate must still fit.
    return (head_record.system == record.system and head_record.model == record.model
            and fits_now())
