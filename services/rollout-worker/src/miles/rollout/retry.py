"""Retry with exponential backoff and jitter within a time budget (for calls to the session server)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class RetryableError(Exception):
    """Raised by an attempt that may succeed later; `retry_after_s` (from a Retry-After header) overrides backoff."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Backoff:
    """Delays initial * multiplier**n capped at max_s, each +/- jitter."""

    initial_s: float = 0.1
    max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delay_s(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * self.multiplier**attempt)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


async def retry_within(
    attempt_fn: Callable[[], Awaitable[T]],
    *,
    budget_s: float,
    backoff: Backoff = Backoff(),
    on_retry: Callable[[RetryableError], None] | None = None,
) -> T:
    """Call `attempt_fn` until it returns, raises a non-retryable error, or `budget_s` is spent (then the last
    RetryableError propagates). The first attempt always runs, even with a zero budget."""
    deadline = time.monotonic() + budget_s
    attempt = 0
    while True:
        try:
            return await attempt_fn()
        except RetryableError as exc:
            delay_s = exc.retry_after_s if exc.retry_after_s is not None else backoff.delay_s(attempt)
            delay_s = min(delay_s, backoff.max_s)
            if time.monotonic() + delay_s > deadline:
                raise
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(delay_s)
            attempt += 1
