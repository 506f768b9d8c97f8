"""The buffer core: validation, waiting (full jobs, long polls) and background upkeep over the Redis store.

It owns no state of its own beyond wake-up signals: everything a group goes through lives in Redis and changes
in one atomic script per transition (see store.py), which is why any number of buffer replicas may serve the
same jobs and why a crashed replica loses nothing. Waiters are woken at once by changes this process makes and
re-check Redis every `poll_interval_s` for changes made by other replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence

from miles.buffer.errors import BufferFullError, InvalidRequestError
from miles.buffer.metrics import BufferMetrics
from miles.buffer.records import (
    AckResult,
    ExtendResult,
    JobConfig,
    JobStats,
    PullResult,
    PushResult,
    RequeuedPrompt,
)
from miles.buffer.settings import BufferSettings
from miles.buffer.store import CapacityReachedError, RedisStore
from miles.buffer.validation import (
    check_group,
    check_job_id,
    check_lease_ids,
    check_lease_s,
    check_pull,
)
from miles.buffer.wire import len_field
from miles.common.aio import wait_event
from miles.proto.common.v1 import common_pb2

log = logging.getLogger(__name__)
_GROUP_JOB_ID_FIELD = common_pb2.Group.DESCRIPTOR.fields_by_name["job_id"].number


class _Signals:
    """Per-job wake-up events: `event(job)` before checking, `notify(job)` after a change."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def event(self, job_id: str) -> asyncio.Event:
        return self._events.setdefault(job_id, asyncio.Event())

    def notify(self, job_id: str) -> None:
        event = self._events.pop(job_id, None)
        if event is not None:
            event.set()

    def notify_all(self) -> None:
        for job_id in list(self._events):
            self.notify(job_id)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    await wait_event(event, timeout_s)


class Buffer:
    """Trajectory groups of every job: push, leased pull within a staleness bound, ack/nack/extend, stats."""

    def __init__(self, store: RedisStore, settings: BufferSettings, metrics: BufferMetrics) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._groups_added = _Signals()
        self._room_freed = _Signals()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    def stop_waiting(self) -> None:
        """Shutting down: every long-poll answers now (pulls with what they have, pushes waiting for room with
        BufferFullError, retryable) instead of holding the shutdown until its deadline."""
        self._stopping = True
        self._groups_added.notify_all()
        self._room_freed.notify_all()

    async def configure_job(self, job_id: str, config: JobConfig) -> JobConfig:
        check_job_id(job_id)
        if config.capacity_groups < 0:
            raise InvalidRequestError("config.capacity_groups must be >= 0", field="config.capacity_groups")
        if config.min_valid_samples < 0:
            raise InvalidRequestError("config.min_valid_samples must be >= 0", field="config.min_valid_samples")
        resolved = JobConfig(
            capacity_groups=config.capacity_groups or self.settings.default_capacity_groups,
            stale_policy=config.stale_policy,
            group_filter=config.group_filter,
            min_valid_samples=config.min_valid_samples or 1,
        )
        await self.store.configure_job(job_id, resolved)
        log.info("job configured", extra={"job_id": job_id, **dataclasses.asdict(resolved)})
        self._room_freed.notify(job_id)
        return resolved

    async def delete_job(self, job_id: str) -> int:
        check_job_id(job_id)
        num_groups = await self.store.delete_job(job_id)
        log.info("job deleted", extra={"job_id": job_id, "num_groups": num_groups})
        self._room_freed.notify(job_id)
        self.metrics.forget_jobs_except(set(await self.store.list_jobs()))
        return num_groups

    async def push_group(
        self, job_id: str, group: common_pb2.Group, *, wait_s: float, group_bytes: bytes | None = None
    ) -> PushResult:
        """Queues `group` (idempotent by group_id); waits up to wait_s for room, then BufferFullError.

        `group_bytes`, when given, must be `group` serialized (the transport passes the bytes it received, so
        that the group is stored without being serialized again)."""
        check_job_id(job_id)
        summary = check_group(job_id, group)
        if not group.job_id:
            group.job_id = job_id
            if group_bytes is not None:
                group_bytes += len_field(_GROUP_JOB_ID_FIELD, job_id.encode())
        if group_bytes is None:
            group_bytes = group.SerializeToString()
        if len(group_bytes) > self.settings.max_group_bytes:
            raise InvalidRequestError(
                f"group is {len(group_bytes)} bytes serialized, above max_group_bytes {self.settings.max_group_bytes}",
                field="group",
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_s)
        while True:
            room = self._room_freed.event(job_id)
            try:
                result = await self.store.push(
                    job_id, group.group_id, group_bytes, summary, group.prompt_index, group.epoch
                )
            except CapacityReachedError:
                remaining_s = deadline - loop.time()
                if remaining_s <= 0 or self._stopping:
                    self.metrics.on_push_full(job_id)
                    raise BufferFullError(
                        f"job {job_id!r} is at capacity; retry after the trainer acks groups",
                        retry_after_s=1.0,
                    ) from None
                await _wait(room, min(self.settings.poll_interval_s, remaining_s))
                continue
            self.metrics.on_push(job_id, result)
            if result.outcome == "queued":
                self._groups_added.notify(job_id)
            return result

    async def pull_batch(
        self,
        job_id: str,
        *,
        num_groups: int,
        trainer_version: int,
        max_staleness: int,
        lease_s: float,
        wait_s: float = 0.0,
        min_groups: int = 0,
        consumer_id: str = "",
    ) -> PullResult:
        """Leases up to num_groups groups within max_staleness, oldest first, long-polling up to wait_s for
        min_groups of them (then returning whatever is there)."""
        check_job_id(job_id)
        check_pull(
            num_groups=num_groups,
            min_groups=min_groups,
            trainer_version=trainer_version,
            max_staleness=max_staleness,
            lease_s=lease_s,
            wait_s=wait_s,
            max_pull_groups=self.settings.max_pull_groups,
            max_lease_s=self.settings.max_lease_s,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, self.settings.pull_wait_max_s)
        total = PullResult()
        while True:
            added = self._groups_added.event(job_id)
            remaining_s = deadline - loop.time()
            final = remaining_s <= 0 or self._stopping
            leased, attempt = await self.store.pull(
                job_id,
                num_groups=num_groups,
                min_groups=1 if final else max(1, min_groups),
                trainer_version=trainer_version,
                max_staleness=max_staleness,
                lease_ms=max(1, round(lease_s * 1000)),
                lease_id_prefix=uuid.uuid4().hex,
                consumer_id=consumer_id,
                max_bytes=self.settings.max_pull_bytes,
            )
            self.metrics.on_pull(job_id, attempt)
            if attempt.num_dropped_stale:
                self._room_freed.notify(job_id)
            total.num_dropped_stale += attempt.num_dropped_stale
            total.num_requeued += attempt.num_requeued
            total.num_expired_leases += attempt.num_expired_leases
            if leased or final:
                total.groups = attempt.groups
                total.lease_expires_unix_ms = attempt.lease_expires_unix_ms
                return total
            await _wait(added, min(self.settings.poll_interval_s, remaining_s))

    async def ack(self, job_id: str, lease_ids: Sequence[str]) -> AckResult:
        check_job_id(job_id)
        check_lease_ids(lease_ids)
        result = await self.store.ack(job_id, lease_ids)
        self.metrics.on_ack(job_id, result.num_acked)
        if result.num_acked:
            self._room_freed.notify(job_id)
        return result

    async def nack(
        self, job_id: str, lease_ids: Sequence[str], *, discard: bool = False, consumer_id: str = "", reason: str = ""
    ) -> int:
        """Gives leases back (or, with discard, deletes their groups); with no lease ids, every lease of
        consumer_id. Returns how many leases were live."""
        check_job_id(job_id)
        check_lease_ids(lease_ids, allow_empty=bool(consumer_id))
        num_returned = await self.store.nack(job_id, lease_ids, discard=discard, consumer_id=consumer_id)
        self.metrics.on_nack(job_id, num_returned, discard=discard)
        if num_returned:
            log.info(
                "groups nacked",
                extra={"job_id": job_id, "num_groups": num_returned, "discard": discard, "reason": reason},
            )
            (self._room_freed if discard else self._groups_added).notify(job_id)
        return num_returned

    async def extend_lease(self, job_id: str, lease_ids: Sequence[str], lease_s: float) -> ExtendResult:
        check_job_id(job_id)
        check_lease_ids(lease_ids)
        check_lease_s(lease_s, self.settings.max_lease_s)
        return await self.store.extend(job_id, lease_ids, max(1, round(lease_s * 1000)))

    async def pull_requeued(self, job_id: str, max_prompts: int) -> list[RequeuedPrompt]:
        check_job_id(job_id)
        if max_prompts < 1:
            raise InvalidRequestError(f"max_prompts must be >= 1, got {max_prompts}", field="max_prompts")
        return await self.store.pull_requeued(job_id, max_prompts)

    async def stats(self, job_id: str) -> JobStats:
        check_job_id(job_id)
        stats = await self.store.stats(job_id)
        self.metrics.set_job_gauges(job_id, stats)
        return stats

    async def ping(self) -> None:
        """Readiness: raises when Redis cannot be reached."""
        await self.store.ping()

    async def reap_expired_leases(self) -> int:
        """Returns the groups of every job's expired leases to their queues; returns how many expired."""
        total = 0
        for job_id in await self.store.list_jobs():
            num_expired = await self.store.reap(job_id)
            if num_expired:
                log.info("leases expired, groups returned to the queue", extra={"job_id": job_id, "num": num_expired})
                self.metrics.on_expired(job_id, num_expired)
                self._groups_added.notify(job_id)
                total += num_expired
        return total

    async def refresh_gauges(self) -> None:
        job_ids = await self.store.list_jobs()
        for job_id in job_ids:
            self.metrics.set_job_gauges(job_id, await self.store.stats(job_id))
        self.metrics.forget_jobs_except(set(job_ids))

    def start_background(self) -> None:
        """Starts lease reaping and gauge refreshing; `close()` stops them."""
        self._tasks = [
            asyncio.create_task(self._every(self.settings.lease_reap_interval_s, self.reap_expired_leases)),
            asyncio.create_task(self._every(self.settings.stats_refresh_interval_s, self.refresh_gauges)),
        ]

    @staticmethod
    async def _every(interval_s: float, step: Callable[[], Awaitable[object]]) -> None:
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                # Upkeep must outlive a Redis outage or a job deleted mid-step; the next round retries.
                log.warning("background step failed", exc_info=True, extra={"step": step.__name__})
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.store.client.aclose()
