"""Answers first on a model server that serves few requests at once.

Ollama serves `OLLAMA_NUM_PARALLEL` requests per model (often one) and queues
the rest. A summary sent while answers wait would take a slot they need, so
this process keeps, per model, at most one summary in flight, and sends none
while an answer it sent is still waiting for its first token (queued behind
another request, or the model loading or reading its prompt). Summaries
written in pieces then hold an answer back for one piece at most.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable

from services.generator.models import normalized

Started = Callable[[], None]


def may_send_summary(answers_waiting: int, summary_in_flight: bool) -> bool:
    return answers_waiting == 0 and not summary_in_flight


class ModelTraffic:
    def __init__(self) -> None:
        self._answers_waiting: Counter[str] = Counter()
        self._summaries: set[str] = set()
        self._held: Counter[str] = Counter()
        self._changed = asyncio.Event()

    def state(self) -> dict[str, dict[str, int]]:
        """Per model: answers waiting for their first token, summaries in
        flight and summaries held back."""
        models = set(self._answers_waiting) | self._summaries | set(self._held)
        return {model: {"answers_waiting": self._answers_waiting[model],
                        "summaries_in_flight": int(model in self._summaries),
                        "summaries_held": self._held[model]} for model in sorted(models)}

    @contextlib.asynccontextmanager
    async def answer(self, model: str) -> AsyncIterator[Started]:
        """An answer's call; the callback it gets says its first token came."""
        key = normalized(model)
        self._answers_waiting[key] += 1
        waiting = True

        def started() -> None:
            nonlocal waiting
            if waiting:
                waiting = False
                self._answers_waiting[key] -= 1
                self._announce()

        try:
            yield started
        finally:
            started()

    @contextlib.asynccontextmanager
    async def summary(self, model: str) -> AsyncIterator[Started]:
        """A summary's call, once the model's answers leave it room."""
        key = normalized(model)
        self._held[key] += 1
        try:
            while not may_send_summary(self._answers_waiting[key], key in self._summaries):
                await self._next_change()
        finally:
            self._held[key] -= 1
        self._summaries.add(key)
        try:
            yield _nothing
        finally:
            self._summaries.discard(key)
            self._announce()

    async def _next_change(self) -> None:
        await self._changed.wait()

    def _announce(self) -> None:
        # Wake every waiter once; the next change needs a new event.
        self._changed.set()
        self._changed = asyncio.Event()


def _nothing() -> None:
    pass
