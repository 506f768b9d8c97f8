"""Waiting with a deadline, and polling loops, without losing a cancellation.

On Python 3.11, `asyncio.wait_for` returns the inner result when a cancellation arrives just as the inner
awaitable completes, so the cancellation is swallowed: a loop that waits that way can miss its shutdown and run on
(the controller hung at shutdown that way). `asyncio.timeout` cancels the current task itself and re-raises a
cancellation that did not come from its deadline, so these helpers use it.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Until `event` is set or `timeout_s` passed; returns whether it is set."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


async def acquire_within(lock: asyncio.Lock, timeout_s: float) -> bool:
    """Acquires `lock` unless `timeout_s` passes first; returns whether it is now held by the caller."""
    try:
        async with asyncio.timeout(timeout_s):
            await lock.acquire()
    except TimeoutError:
        return False
    return True


def cancel_requested() -> bool:
    """Whether the running task was asked to stop, even if the CancelledError was swallowed on its way up (a library
    that turns a cancellation into an error that a retry loop catches leaves the task `cancelling`)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancel_requested() -> None:
    """Raises CancelledError when the running task was asked to stop: a polling loop calls it at each turn so that
    a cancellation lost inside one call still ends the loop."""
    if cancel_requested():
        raise asyncio.CancelledError
