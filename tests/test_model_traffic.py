"""Answers first: a summary waits while an answer for its model waits for its
first token, and only one summary per model is in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.generator.model_traffic import ModelTraffic, may_send_summary


async def settled() -> None:
    # Let every task that can run do so (no clock involved).
    for _ in range(10):
        await asyncio.sleep(0)


def test_the_rule() -> None:
    assert may_send_summary(0, False)
    assert not may_send_summary(1, False)
    assert not may_send_summary(0, True)


async def test_a_summary_waits_for_the_answers_first_token() -> None:
    traffic = ModelTraffic()
    sent: list[str] = []

    async def summarise() -> None:
        async with traffic.summary("m"):
            sent.append("summary")

    async with traffic.answer("m:latest") as started:
        task = asyncio.create_task(summarise())
        await settled()
        assert sent == [] and traffic.state()["m:latest"]["summaries_held"] == 1
        started()
        await task
        assert sent == ["summary"]


async def test_an_answer_that_fails_before_its_first_token_lets_summaries_go() -> None:
    traffic = ModelTraffic()
    task: asyncio.Task[None] | None = None

    async def summarise() -> None:
        async with traffic.summary("m"):
            pass

    try:
        async with traffic.answer("m"):
            task = asyncio.create_task(summarise())
            await settled()
            raise RuntimeError("the model failed")
    except RuntimeError:
        pass
    assert task is not None
    await task
    assert traffic.state()["m:latest"] == {"answers_waiting": 0, "summaries_in_flight": 0,
                                           "summaries_held": 0}


async def test_one_summary_in_flight_per_model() -> None:
    traffic = ModelTraffic()
    inside: list[str] = []
    leave = {name: asyncio.Event() for name in ("first", "second", "other")}

    def summarise(name: str, model: str) -> Callable[[], asyncio.Task[None]]:
        async def run() -> None:
            async with traffic.summary(model):
                inside.append(name)
                await leave[name].wait()
        return lambda: asyncio.create_task(run())

    tasks = [summarise("first", "m")(), summarise("second", "m")(),
             summarise("other", "n")()]
    await settled()
    assert inside == ["first", "other"]  # another model has its own turn
    leave["first"].set()
    await settled()
    assert inside == ["first", "other", "second"]
    for event in leave.values():
        event.set()
    await asyncio.gather(*tasks)
