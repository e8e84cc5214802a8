"""A session's queries in one process run one at a time, in arrival order."""

from __future__ import annotations

import asyncio

from services.generator.arrival_order import ArrivalOrder, HandBacks


async def test_a_query_arriving_as_the_lock_passes_on_waits_for_the_woken_one() -> None:
    """A hands over to the waiting B, and C arrives in that same step, before B
    has run: C still waits for B."""
    order, trace = ArrivalOrder(), []
    a_may_finish = asyncio.Event()
    later: list[asyncio.Task[None]] = []

    async def query(name: str) -> None:
        async with order.turn("s"):
            trace.append(f"{name} in")
            if name == "A":
                await a_may_finish.wait()
            await asyncio.sleep(0)
            trace.append(f"{name} out")
        if name == "A":  # the lock is released and B woken, but B has not run
            later.append(asyncio.create_task(query("C")))

    a = asyncio.create_task(query("A"))
    await asyncio.sleep(0)
    b = asyncio.create_task(query("B"))
    await asyncio.sleep(0)  # B now waits for A
    a_may_finish.set()
    await asyncio.gather(a, b)
    await asyncio.gather(*later)
    assert trace == ["A in", "A out", "B in", "B out", "C in", "C out"]
    assert len(order) == 0


async def test_sessions_do_not_wait_for_each_other_and_nothing_is_kept() -> None:
    order, inside = ArrivalOrder(), set()
    both_in = asyncio.Event()

    async def query(sid: str) -> None:
        async with order.turn(sid):
            inside.add(sid)
            if len(inside) == 2:
                both_in.set()
            await asyncio.wait_for(both_in.wait(), 1)

    await asyncio.gather(query("x"), query("y"))
    assert len(order) == 0


async def test_a_failing_query_frees_the_session() -> None:
    order = ArrivalOrder()
    try:
        async with order.turn("s"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    async with asyncio.timeout(1):
        async with order.turn("s"):
            pass
    assert len(order) == 0


def test_a_hand_back_waits_longer_each_time_up_to_a_cap() -> None:
    hand_backs = HandBacks(first_s=0.02, cap_s=0.5)
    delays = [hand_backs.delay("q2", earlier_seq=1) for _ in range(8)]
    assert delays == [0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.5]


def test_a_hand_back_starts_short_again_once_the_earlier_query_moved() -> None:
    hand_backs = HandBacks(first_s=0.02, cap_s=0.5)
    for _ in range(4):
        hand_backs.delay("q3", earlier_seq=1)
    assert hand_backs.delay("q3", earlier_seq=2) == 0.02  # the first was answered
    assert hand_backs.delay("q4", earlier_seq=2) == 0.02  # each query counts its own
    hand_backs.forget("q3")
    assert hand_backs.delay("q3", earlier_seq=2) == 0.02
