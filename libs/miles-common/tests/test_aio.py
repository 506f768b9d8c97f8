"""miles.common.aio: deadlines that report timeouts and never swallow a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from miles.common.aio import acquire_within, wait_event


async def test_wait_event_reports_set_and_timeout() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 30.0)


async def test_wait_event_propagates_cancellation() -> None:
    event = asyncio.Event()
    waiter = asyncio.create_task(wait_event(event, 30.0))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_cancellation_as_the_event_is_set_is_not_swallowed() -> None:
    """The Python 3.11 wait_for race: the awaited thing completes and the task is cancelled in the same loop
    iteration. The cancellation must still end the task."""
    event = asyncio.Event()
    waiter = asyncio.create_task(wait_event(event, 30.0))
    await asyncio.sleep(0.01)
    event.set()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_acquire_within_holds_the_lock_or_times_out() -> None:
    lock = asyncio.Lock()
    assert await acquire_within(lock, 1.0)
    assert lock.locked()
    assert not await acquire_within(lock, 0.01)
    lock.release()
    assert not lock.locked()


async def test_acquire_within_propagates_cancellation_and_leaves_the_lock_free() -> None:
    lock = asyncio.Lock()
    await lock.acquire()
    waiter = asyncio.create_task(acquire_within(lock, 30.0))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    lock.release()
    assert await acquire_within(lock, 1.0)
