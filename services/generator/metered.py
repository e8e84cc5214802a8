"""A model provider that times its calls for /metrics: the whole call, and
for a streamed one the wait for its first token."""

from __future__ import annotations

import asyncio

from services.generator.models import ModelFacts
from services.generator.provider import ChatProvider, ChatRequest, ChatResult, OnToken
from services.shared import metrics


class MeteredProvider:
    def __init__(self, provider: ChatProvider, purpose: str) -> None:
        self._provider = provider
        self._purpose = purpose  # "answer" or "summary": a bounded label

    async def chat(self, request: ChatRequest, on_token: OnToken | None = None) -> ChatResult:
        measured = metrics.generator()
        timer = metrics.Timer()
        first: list[bool] = []

        async def forward(text: str) -> None:
            if not first:
                first.append(True)
                measured.first_token.observe(timer.elapsed())
            assert on_token is not None
            await on_token(text)

        try:
            result = await self._provider.chat(request, forward if on_token else None)
        except asyncio.CancelledError:
            raise  # a head start thrown away: not a model time
        except Exception:
            measured.model_time.labels(self._purpose).observe(timer.elapsed())
            raise
        measured.model_time.labels(self._purpose).observe(timer.elapsed())
        return result

    async def facts(self, model: str) -> ModelFacts:
        return await self._provider.facts(model)

    async def close(self) -> None:
        await self._provider.close()
