"""The control API's checkpoint requests (`Trainer.request_checkpoint`): held until the loop reaches a point
between its phases (never in the middle of a step) and answered there, all by one checkpoint.

A checkpoint that raises (or is cancelled) answers the requests it was serving with TrainerNotRunningError naming
the error, then the error goes on to the loop, which fails; `fail` answers those still waiting. No request is
left waiting for an answer that cannot come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from miles.trainer.errors import TrainerNotRunningError


@dataclass(frozen=True)
class CheckpointOutcome:
    step: int
    path: str
    num_groups_acked: int


class CheckpointRequests:
    """The requests waiting for the loop's next checkpoint."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[CheckpointOutcome]] = []

    async def wait(self) -> CheckpointOutcome:
        """Until the loop serves this request (`serve`) or fails (`fail`)."""
        waiter: asyncio.Future[CheckpointOutcome] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return await waiter

    async def serve(self, checkpoint: Callable[[], Awaitable[CheckpointOutcome]]) -> None:
        """With requests waiting: one `checkpoint()`, whose outcome answers every one of them."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        try:
            outcome = await checkpoint()
        except BaseException as exc:
            error = TrainerNotRunningError(f"the checkpoint failed: {type(exc).__name__}: {exc}")
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(error)
            raise
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(outcome)

    def fail(self, error: str) -> None:
        """Answer every waiting request with TrainerNotRunningError(error)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(TrainerNotRunningError(error))
        self._waiters = []
