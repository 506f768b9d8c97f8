"""Async client of the buffer service, used by rollout workers (push) and the trainer (pull, ack, extend).

    async with BufferClient("buffer:50051") as buffer:
        await buffer.configure_job("job-1", capacity_groups=256, stale_policy="drop")
        await buffer.push_group("job-1", group)                      # idempotent by group.group_id
        batch = await buffer.pull_batch("job-1", num_groups=8, trainer_version=3, max_staleness=1,
                                        lease_s=300, wait_s=30)
        ...train on [leased.group for leased in batch.groups]...
        await buffer.ack("job-1", [leased.lease_id for leased in batch.groups])

Every call is retried with exponential backoff and jitter on UNAVAILABLE and DEADLINE_EXCEEDED (a restarting
buffer or Redis), which is safe because every buffer call is idempotent except PullBatch, whose only risk is
that the leases of a lost reply stay held until they expire. Failures raise the typed MilesError the server
raised (`InvalidArgumentError` with `.field`, `ResourceExhaustedError` when a job stayed full, ...), via
`miles.common.grpc_client.error_from_rpc_error`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, TypeVar

import grpc

from miles.buffer.wire import len_field
from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.proto.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from miles.proto.common.v1 import common_pb2

ResponseT = TypeVar("ResponseT")
_PUSH_GROUP_FIELD = buffer_pb2.PushGroupRequest.DESCRIPTOR.fields_by_name["group"].number
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_STALE_POLICIES = {
    "drop": buffer_pb2.STALE_POLICY_DROP,
    "requeue": buffer_pb2.STALE_POLICY_REQUEUE,
    "mask": buffer_pb2.STALE_POLICY_MASK,
}
_GROUP_FILTERS = {
    "none": buffer_pb2.GROUP_FILTER_NONE,
    "drop_equal_rewards": buffer_pb2.GROUP_FILTER_DROP_EQUAL_REWARDS,
}

# Outcomes of push_group that mean "the buffer has (or had) this group": both are success for a producer.
ACCEPTED_OUTCOMES = frozenset({buffer_pb2.PUSH_OUTCOME_QUEUED, buffer_pb2.PUSH_OUTCOME_DUPLICATE})


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per call and the backoff between them (initial * multiplier**n, capped, +/- jitter).

    The defaults ride out about 7 s of unavailability (a buffer or Redis restart) before raising."""

    max_attempts: int = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def backoff_s(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


class BufferClient:
    """One channel to the buffer; share one instance per process (it is safe for concurrent tasks)."""

    def __init__(
        self,
        target: str,
        *,
        call_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        operator_token: str = "",
    ) -> None:
        """`target` is "host:port"; `call_timeout_s` bounds each attempt (long polls and full-job waits add
        their own wait on top); `operator_token` is sent on every call (ConfigureJob and DeleteJob need it)."""
        self.target = target
        self.call_timeout_s = call_timeout_s
        self.retry = retry or RetryPolicy()
        self._channel = create_channel(target, retry_unavailable=False, bearer_token=operator_token)
        self._stub = buffer_pb2_grpc.BufferServiceStub(self._channel)  # type: ignore[no-untyped-call]
        # PushGroup with a prebuilt request: building PushGroupRequest(group=group) would copy the whole group
        # (about as costly as serializing it) only to serialize it right after.
        self._push_group_bytes = self._channel.unary_unary(
            "/miles.buffer.v1.BufferService/PushGroup",
            request_serializer=None,
            response_deserializer=buffer_pb2.PushGroupResponse.FromString,
        )

    async def __aenter__(self) -> BufferClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Callable[..., Awaitable[ResponseT]], request: object, timeout_s: float) -> ResponseT:
        for attempt in range(self.retry.max_attempts):
            try:
                return await method(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE or attempt + 1 >= self.retry.max_attempts:
                    raise error_from_rpc_error(exc) from exc
            await asyncio.sleep(self.retry.backoff_s(attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def configure_job(
        self,
        job_id: str,
        *,
        capacity_groups: int = 0,
        stale_policy: Literal["drop", "requeue", "mask"] = "drop",
        group_filter: Literal["none", "drop_equal_rewards"] = "none",
        min_valid_samples: int = 1,
    ) -> buffer_pb2.JobBufferConfig:
        """Creates or updates the job's buffer (capacity_groups 0: the service default); returns it resolved."""
        config = buffer_pb2.JobBufferConfig(
            capacity_groups=capacity_groups,
            stale_policy=_STALE_POLICIES[stale_policy],
            group_filter=_GROUP_FILTERS[group_filter],
            min_valid_samples=min_valid_samples,
        )
        request = buffer_pb2.ConfigureJobRequest(job_id=job_id, config=config)
        response = await self._call(self._stub.ConfigureJob, request, self.call_timeout_s)
        config_in_force: buffer_pb2.JobBufferConfig = response.config
        return config_in_force

    async def delete_job(self, job_id: str) -> int:
        """Deletes the job's buffer and its groups; returns how many groups were deleted."""
        request = buffer_pb2.DeleteJobRequest(job_id=job_id)
        response = await self._call(self._stub.DeleteJob, request, self.call_timeout_s)
        return int(response.num_groups_deleted)

    async def push_group(
        self, job_id: str, group: common_pb2.Group, *, wait_s: float = 30.0
    ) -> buffer_pb2.PushGroupResponse:
        """Pushes a finished group. QUEUED and DUPLICATE both mean the buffer has it (see ACCEPTED_OUTCOMES).
        Waits up to wait_s while the job is full, then raises ResourceExhaustedError (back off, retry later)."""
        # On the wire wait_s = 0 means "until the deadline"; a caller asking for no wait gets the smallest wait.
        head = buffer_pb2.PushGroupRequest(job_id=job_id, wait_s=max(wait_s, 0.001)).SerializeToString()
        request = head + len_field(_PUSH_GROUP_FIELD, group.SerializeToString())
        return await self._call(self._push_group_bytes, request, wait_s + self.call_timeout_s)

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
    ) -> buffer_pb2.PullBatchResponse:
        """Leases up to num_groups groups with staleness <= max_staleness, oldest first; waits up to wait_s for
        min_groups (default 1) of them. Ack each lease after its effect is durable, before lease_s runs out
        (or extend_lease); otherwise the group is delivered again."""
        request = buffer_pb2.PullBatchRequest(
            job_id=job_id,
            num_groups=num_groups,
            trainer_version=trainer_version,
            max_staleness=max_staleness,
            lease_s=lease_s,
            wait_s=wait_s,
            min_groups=min_groups,
            consumer_id=consumer_id,
        )
        return await self._call(self._stub.PullBatch, request, wait_s + self.call_timeout_s)

    async def ack(self, job_id: str, lease_ids: Sequence[str]) -> buffer_pb2.AckResponse:
        """Removes the leased groups for good; idempotent. Leases in expired_lease_ids were not acked."""
        request = buffer_pb2.AckRequest(job_id=job_id, lease_ids=lease_ids)
        return await self._call(self._stub.Ack, request, self.call_timeout_s)

    async def nack(self, job_id: str, lease_ids: Sequence[str], *, reason: str = "", discard: bool = False) -> int:
        """Returns the leased groups to the queue now (discard=True deletes them); returns how many were live."""
        request = buffer_pb2.NackRequest(job_id=job_id, lease_ids=lease_ids, reason=reason, discard=discard)
        response = await self._call(self._stub.Nack, request, self.call_timeout_s)
        return int(response.num_returned)

    async def release_consumer(self, job_id: str, consumer_id: str, *, reason: str = "") -> int:
        """Returns every group leased by consumer_id to the queue (a restarted consumer's first call)."""
        request = buffer_pb2.NackRequest(job_id=job_id, consumer_id=consumer_id, reason=reason)
        response = await self._call(self._stub.Nack, request, self.call_timeout_s)
        return int(response.num_returned)

    async def extend_lease(
        self, job_id: str, lease_ids: Sequence[str], lease_s: float
    ) -> buffer_pb2.ExtendLeaseResponse:
        """Sets the leases to expire lease_s from now; leases in expired_lease_ids are no longer held."""
        request = buffer_pb2.ExtendLeaseRequest(job_id=job_id, lease_ids=lease_ids, lease_s=lease_s)
        return await self._call(self._stub.ExtendLease, request, self.call_timeout_s)

    async def pull_requeued(self, job_id: str, max_prompts: int = 64) -> list[buffer_pb2.RequeuedPrompt]:
        """Takes prompts whose groups went stale under the requeue policy, for rollout to regenerate."""
        request = buffer_pb2.PullRequeuedRequest(job_id=job_id, max_prompts=max_prompts)
        response = await self._call(self._stub.PullRequeued, request, self.call_timeout_s)
        return list(response.prompts)

    async def stats(self, job_id: str) -> buffer_pb2.StatsResponse:
        request = buffer_pb2.StatsRequest(job_id=job_id)
        return await self._call(self._stub.Stats, request, self.call_timeout_s)
