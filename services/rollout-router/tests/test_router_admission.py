"""Per-engine admission: concurrency limit, FIFO hand-off, bounded queue, timeouts, rejection, idle waits."""

from __future__ import annotations

import asyncio

import pytest

from miles.router.admission import EngineSlots, QueueRejectedError
from miles.router.errors import BackpressureError


async def settle() -> None:
    """Let every ready task run (a hand-off takes a few loop iterations through wait_for and shield)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def test_waiters_get_slots_in_arrival_order() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=10)
    await slots.acquire(1, timeout_s=5)
    order: list[int] = []

    async def waiter(index: int) -> None:
        await slots.acquire(10 + index, timeout_s=5)
        order.append(index)

    tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
    await settle()
    assert slots.num_queued == 4
    assert slots.num_queued_tokens == sum(10 + i for i in range(4))
    assert slots.load_requests == 5
    slots.release(1)
    for expected in range(4):
        await settle()
        assert order == list(range(expected + 1))
        assert slots.num_in_flight == 1  # the slot was handed over, never freed in between
        slots.release(10 + expected)
    await asyncio.gather(*tasks)
    assert slots.is_idle() and slots.num_queued_tokens == 0 and slots.num_in_flight_tokens == 0


async def test_newcomer_cannot_overtake_the_queue() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=10)
    await slots.acquire(1, timeout_s=5)
    queued = asyncio.create_task(slots.acquire(1, timeout_s=5))
    await settle()
    slots.release(1)
    assert not slots.has_free_slot()  # the queued request owns the slot already
    late = asyncio.create_task(slots.acquire(1, timeout_s=5))
    await queued
    await settle()
    assert not late.done()
    slots.release(1)
    await late
    slots.release(1)


async def test_full_queue_is_refused() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=1)
    await slots.acquire(1, timeout_s=5)
    queued = asyncio.create_task(slots.acquire(1, timeout_s=5))
    await settle()
    assert not slots.can_enqueue()
    with pytest.raises(BackpressureError):
        await slots.acquire(1, timeout_s=5)
    slots.release(1)
    await queued
    slots.release(1)


async def test_queue_timeout_leaves_the_queue_clean() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=4)
    await slots.acquire(1, timeout_s=5)
    with pytest.raises(BackpressureError, match="waited"):
        await slots.acquire(7, timeout_s=0.01)
    assert slots.num_queued == 0 and slots.num_queued_tokens == 0
    slots.release(1)
    assert slots.is_idle()


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=4)
    await slots.acquire(1, timeout_s=5)
    waiter = asyncio.create_task(slots.acquire(1, timeout_s=5))
    await settle()
    slots.release(1)  # hands the slot to the waiter ...
    waiter.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert slots.num_in_flight == 0 and slots.is_idle()


async def test_reject_waiters_sends_queued_requests_away() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=4)
    await slots.acquire(1, timeout_s=5)
    waiters = [asyncio.create_task(slots.acquire(2, timeout_s=5)) for _ in range(2)]
    await settle()
    assert slots.reject_waiters() == 2
    for waiter in waiters:
        with pytest.raises(QueueRejectedError):
            await waiter
    assert slots.num_in_flight == 1 and slots.num_queued == 0 and slots.num_queued_tokens == 0


async def test_resize_admits_waiters_and_wait_idle_reports() -> None:
    slots = EngineSlots(max_concurrency=1, max_queue=4)
    await slots.acquire(1, timeout_s=5)
    waiter = asyncio.create_task(slots.acquire(1, timeout_s=5))
    await settle()
    slots.resize(2)
    await waiter
    assert slots.num_in_flight == 2
    assert await slots.wait_idle(0.01) is False
    idle = asyncio.create_task(slots.wait_idle(5))
    slots.release(1)
    slots.release(1)
    assert await idle is True
