"""Pushing finished groups to the buffer, and the backpressure signal that pauses new episodes.

A push waits up to `push_wait_s` for room; a full buffer (RESOURCE_EXHAUSTED), an unreachable one (after the
client's own retries) or a job the buffer does not know yet (the controller configures it) make the group wait
and retry with backoff — nothing is dropped — and, while any push waits, `wait_until_clear()` holds the
scheduler back from starting new episodes. Pushes are idempotent by group id, so retrying is always safe.
"""

from __future__ import annotations

import asyncio
import logging

from miles.buffer.client import BufferClient
from miles.common.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from miles.proto.buffer.v1 import buffer_pb2
from miles.proto.common.v1 import common_pb2
from miles.rollout import samples as sample_ops
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.retry import Backoff

log = logging.getLogger(__name__)

_OUTCOMES = {
    buffer_pb2.PUSH_OUTCOME_QUEUED: "queued",
    buffer_pb2.PUSH_OUTCOME_DUPLICATE: "duplicate",
    buffer_pb2.PUSH_OUTCOME_REJECTED_ALL_ABORTED: "rejected_all_aborted",
    buffer_pb2.PUSH_OUTCOME_FILTERED: "buffer_filtered",
}


class GroupPusher:
    def __init__(
        self,
        buffer: BufferClient,
        *,
        job_id: str,
        metrics: RolloutMetrics,
        push_wait_s: float,
        backoff: Backoff = Backoff(initial_s=0.2, max_s=5.0),
    ) -> None:
        self.buffer = buffer
        self.job_id = job_id
        self.metrics = metrics
        self.push_wait_s = push_wait_s
        self.backoff = backoff
        self._num_blocked = 0
        self._clear = asyncio.Event()
        self._clear.set()

    @property
    def paused(self) -> bool:
        return self._num_blocked > 0

    async def wait_until_clear(self) -> None:
        """Returns at once unless a push is waiting for the buffer; then when none is."""
        await self._clear.wait()

    def _set_blocked(self, blocked: bool) -> None:
        self._num_blocked += 1 if blocked else -1
        self.metrics.paused.set(1 if self._num_blocked else 0)
        if self._num_blocked:
            self._clear.clear()
        else:
            self._clear.set()

    async def push(self, group: common_pb2.Group) -> str:
        """Pushes until the buffer decides; returns the outcome (queued, duplicate, ...). Never drops a group."""
        attempt = 0
        blocked = False
        try:
            while True:
                try:
                    response = await self.buffer.push_group(self.job_id, group, wait_s=self.push_wait_s)
                    break
                except ResourceExhaustedError as exc:
                    cause, delay_s = "resource_exhausted", exc.retry_after_s
                except InvalidArgumentError as exc:
                    if exc.field != "job_id":
                        log.error(
                            "the buffer refused a group", extra={"group_id": group.group_id, "error": exc.message}
                        )
                        self.metrics.groups.labels(outcome="invalid").inc()
                        return "invalid"
                    cause, delay_s = "job_not_configured", None
                except (UnavailableError, DeadlineExceededError):
                    cause, delay_s = "unavailable", None
                if not blocked:
                    blocked = True
                    self._set_blocked(True)
                self.metrics.push_retries.labels(cause=cause).inc()
                await asyncio.sleep(min(delay_s or self.backoff.delay_s(attempt), self.backoff.max_s))
                attempt += 1
        finally:
            if blocked:
                self._set_blocked(False)
        outcome = _OUTCOMES.get(response.outcome, "unknown")
        self.metrics.groups.labels(outcome=outcome).inc()
        if outcome == "queued":
            for sample in group.samples:
                status = sample_ops.status_name(sample.status)
                self.metrics.samples.labels(status=status, role=sample_ops.role_of(sample)).inc()
                if sample_ops.is_trainable(sample):
                    self.metrics.response_tokens.inc(sample_ops.num_response_tokens(sample))
        return outcome
