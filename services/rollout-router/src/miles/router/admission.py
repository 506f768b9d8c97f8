"""Per-engine admission: a concurrency limit with a fair (FIFO) queue in front of it.

`EngineSlots` is a semaphore sized to the engine's capacity whose waiters are served strictly in arrival order:
a finishing request hands its slot directly to the oldest waiter (first-completed wakeup), so a newcomer can never
overtake a queued request. The queue is bounded (`max_queue`); `can_enqueue()` lets the pool skip full engines and
answer 429 when every one is full. It also tracks the load the routing policies compare: requests in flight,
requests queued and their estimated prompt tokens.

Limits: fairness is by arrival, not per session or per job (a pool belongs to one job). Single event loop only.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from miles.common.aio import wait_event
from miles.router.errors import BackpressureError


class QueueRejectedError(Exception):
    """A queued request was sent away because its engine stopped taking requests (unhealthy, draining, removed);
    the pool re-selects an engine for it."""


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    num_tokens: int


@dataclass(eq=False)
class EngineSlots:
    """Concurrency limit + bounded FIFO queue of one engine. Not thread-safe (one event loop)."""

    max_concurrency: int
    max_queue: int
    num_in_flight: int = 0
    num_in_flight_tokens: int = 0
    num_queued_tokens: int = 0
    _waiters: collections.deque[_Waiter] = field(default_factory=collections.deque)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self._idle.set()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    @property
    def load_requests(self) -> int:
        """Requests in flight plus queued: the load every policy compares first."""
        return self.num_in_flight + len(self._waiters)

    @property
    def load_tokens(self) -> int:
        """Estimated prompt tokens in flight plus queued: the tie-breaker after load_requests."""
        return self.num_in_flight_tokens + self.num_queued_tokens

    def has_free_slot(self) -> bool:
        return self.num_in_flight < self.max_concurrency and not self._waiters

    def can_enqueue(self) -> bool:
        """True when a new request would start now or find room in the queue."""
        return self.has_free_slot() or len(self._waiters) < self.max_queue

    def is_idle(self) -> bool:
        return self.num_in_flight == 0 and not self._waiters

    async def acquire(self, num_tokens: int, timeout_s: float) -> float:
        """Take a slot, waiting in FIFO order up to timeout_s; returns the seconds waited.

        Raises BackpressureError when the queue is full or the wait times out.
        """
        if self.has_free_slot():
            self._start(num_tokens)
            return 0.0
        if len(self._waiters) >= self.max_queue:
            raise BackpressureError("engine queue is full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), num_tokens)
        self._waiters.append(waiter)
        self.num_queued_tokens += num_tokens
        self._idle.clear()
        start_s = loop.time()
        timer = loop.call_later(timeout_s, self._time_out, waiter, timeout_s)
        try:
            await waiter.future
        except BaseException:
            self._abandon(waiter)
            raise
        finally:
            timer.cancel()
        return loop.time() - start_s

    def release(self, num_tokens: int) -> None:
        """Give back a slot taken with `num_tokens`; the oldest waiter (if any) gets it at once."""
        self.num_in_flight -= 1
        self.num_in_flight_tokens -= num_tokens
        self._wake_waiters()
        if self.is_idle():
            self._idle.set()

    def resize(self, max_concurrency: int) -> None:
        """Change the limit at run time; a larger limit admits waiters immediately."""
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        self.max_concurrency = max_concurrency
        self._wake_waiters()

    def reject_waiters(self) -> int:
        """Send every queued request away (QueueRejectedError); returns how many."""
        rejected = 0
        while self._waiters:
            waiter = self._waiters.popleft()
            self.num_queued_tokens -= waiter.num_tokens
            if not waiter.future.done():
                waiter.future.set_exception(QueueRejectedError("engine stopped taking requests"))
                rejected += 1
        if self.is_idle():
            self._idle.set()
        return rejected

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight or queued; returns whether that happened within timeout_s."""
        if await wait_event(self._idle, timeout_s):
            return True
        return self.is_idle()

    def _start(self, num_tokens: int) -> None:
        self.num_in_flight += 1
        self.num_in_flight_tokens += num_tokens
        self._idle.clear()

    def _wake_waiters(self) -> None:
        while self._waiters and self.num_in_flight < self.max_concurrency:
            waiter = self._waiters.popleft()
            self.num_queued_tokens -= waiter.num_tokens
            if waiter.future.done():  # cancelled while queued; _abandon sees it gone
                continue
            self._start(waiter.num_tokens)
            waiter.future.set_result(None)

    def _time_out(self, waiter: _Waiter, timeout_s: float) -> None:
        if not waiter.future.done():
            waiter.future.set_exception(BackpressureError(f"waited {timeout_s:g}s in the engine queue"))

    def _abandon(self, waiter: _Waiter) -> None:
        """A waiter gave up (timeout or cancellation): leave the queue, or hand back a slot it was just given."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self.num_queued_tokens -= waiter.num_tokens
            waiter.future.cancel()
        elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.num_tokens)
        if self.is_idle():
            self._idle.set()
