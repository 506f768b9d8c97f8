"""The gRPC API of a real miles-buffer: bad input is INVALID_ARGUMENT naming the field and stores nothing; a full
job answers RESOURCE_EXHAUSTED; metrics are exported."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import httpx
import pytest
import redis

from miles.common.errors import InvalidArgumentError, ResourceExhaustedError
from miles.proto.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from miles.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from conftest import BufferProcess

GroupFactory = Callable[..., common_pb2.Group]
Mutation = Callable[[common_pb2.Group], None]


def _empty_group(group: common_pb2.Group) -> None:
    del group.samples[:]


def _long_loss_mask(group: common_pb2.Group) -> None:
    group.samples[1].loss_mask.append(1)


def _short_logprobs(group: common_pb2.Group) -> None:
    del group.samples[0].rollout_logprobs[-1]


def _tokens_shorter_than_response(group: common_pb2.Group) -> None:
    del group.samples[0].tokens[-1]


def _bad_span(group: common_pb2.Group) -> None:
    group.samples[0].weight_versions[0].end = 1000


def _job_keys(process: BufferProcess, job_id: str) -> list[bytes]:
    client = redis.Redis.from_url(process.redis_url)
    try:
        return sorted(client.keys(f"miles:buffer:{{{job_id}}}:*"))
    finally:
        client.close()


def _group_data_count(process: BufferProcess, job_id: str) -> int:
    client = redis.Redis.from_url(process.redis_url)
    try:
        prefix = f"miles:buffer:{{{job_id}}}"
        return int(client.hlen(f"{prefix}:data")) + int(client.zcard(f"{prefix}:done"))
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_empty_group, "group.samples"),
        (_long_loss_mask, "group.samples[1].loss_mask"),
        (_short_logprobs, "group.samples[0].rollout_logprobs"),
        (_tokens_shorter_than_response, "group.samples[0].loss_mask"),
        (_bad_span, "group.samples[0].weight_versions[0]"),
    ],
    ids=["empty_group", "long_loss_mask", "short_logprobs", "tokens_shorter_than_response", "bad_weight_span"],
)
async def test_bad_group_is_invalid_argument_and_stores_nothing(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str, mutate: Mutation, field: str
) -> None:
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=8)
        group = make_group("g-bad")
        mutate(group)
        async with grpc.aio.insecure_channel(shared_buffer.target) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await stub.PushGroup(buffer_pb2.PushGroupRequest(job_id=job_id, group=group), timeout=10)
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("miles-error-field", field) in tuple(raw.value.trailing_metadata() or ())
        with pytest.raises(InvalidArgumentError) as typed:
            await buffer.push_group(job_id, group)
        assert typed.value.field == field
        assert _group_data_count(shared_buffer, job_id) == 0
        stats = await buffer.stats(job_id)
        assert (stats.pushed_total, stats.queued_groups, stats.duplicate_pushes_total) == (0, 0, 0)
        # Nothing about the id was remembered either: the corrected group is accepted under the same id.
        fixed = await buffer.push_group(job_id, make_group("g-bad"))
        assert fixed.outcome == buffer_pb2.PUSH_OUTCOME_QUEUED


@pytest.mark.integration
async def test_unknown_job_is_invalid_argument_and_creates_no_keys(
    shared_buffer: BufferProcess, make_group: GroupFactory
) -> None:
    async with shared_buffer.client() as buffer:
        with pytest.raises(InvalidArgumentError) as push_error:
            await buffer.push_group("never-configured", make_group("g"))
        with pytest.raises(InvalidArgumentError) as pull_error:
            await buffer.pull_batch("never-configured", num_groups=1, trainer_version=0, max_staleness=0, lease_s=5)
        with pytest.raises(InvalidArgumentError) as stats_error:
            await buffer.stats("never-configured")
    assert push_error.value.field == pull_error.value.field == stats_error.value.field == "job_id"
    assert _job_keys(shared_buffer, "never-configured") == []


@pytest.mark.integration
@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"max_staleness": -1}, "max_staleness"), ({"num_groups": 0}, "num_groups"), ({"lease_s": 0.0}, "lease_s")],
    ids=["negative_staleness_bound", "zero_groups", "zero_lease"],
)
async def test_bad_pull_is_invalid_argument_and_leases_nothing(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str, overrides: dict[str, float], field: str
) -> None:
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=8)
        await buffer.push_group(job_id, make_group("g"))
        arguments = {"num_groups": 1, "trainer_version": 0, "max_staleness": 0, "lease_s": 5.0, **overrides}
        with pytest.raises(InvalidArgumentError) as caught:
            await buffer.pull_batch(job_id, **arguments)  # type: ignore[arg-type]
        assert caught.value.field == field
        stats = await buffer.stats(job_id)
        assert (stats.queued_groups, stats.leased_groups, stats.pulled_total) == (1, 0, 0)


@pytest.mark.integration
async def test_full_job_answers_resource_exhausted(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=1)
        await buffer.push_group(job_id, make_group("g0"))
        with pytest.raises(ResourceExhaustedError) as caught:
            await buffer.push_group(job_id, make_group("g1"), wait_s=0.2)
        assert caught.value.retry_after_s is not None
        assert (await buffer.stats(job_id)).queued_groups == 1


@pytest.mark.integration
async def test_metrics_export_queue_counters_and_staleness(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=8)
        for index in range(3):
            await buffer.push_group(job_id, make_group(f"g{index}", versions=(index,)))
        batch = await buffer.pull_batch(job_id, num_groups=2, trainer_version=2, max_staleness=5, lease_s=30)
        await buffer.ack(job_id, [leased.lease_id for leased in batch.groups])
        await buffer.stats(job_id)  # refreshes this job's gauges at once
    async with httpx.AsyncClient() as http:
        text = (await http.get(shared_buffer.metrics_url)).text
    label = f'job_id="{job_id}"'
    expected = {
        "miles_buffer_pushed_groups_total": 3,
        "miles_buffer_pulled_groups_total": 2,
        "miles_buffer_acked_groups_total": 2,
        "miles_buffer_queued_groups": 1,
        "miles_buffer_queued_samples": 2,
        "miles_buffer_queued_tokens": 16,
        "miles_buffer_leased_groups": 0,
        "miles_buffer_pulled_group_staleness_steps_count": 2,
        "miles_buffer_pulled_staleness_avg_steps": 1.5,
        "miles_buffer_pulled_staleness_max_steps": 2,
    }
    for name, value in expected.items():
        assert f"{name}{{{label}}} {float(value)}" in text, name
    assert f"miles_buffer_oldest_group_age_seconds{{{label}}}" in text


@pytest.mark.integration
async def test_client_lease_calls_round_trip(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=8)
        for name in ("a", "b"):
            await buffer.push_group(job_id, make_group(name))
        first = await buffer.pull_batch(
            job_id, num_groups=2, trainer_version=0, max_staleness=0, lease_s=60, consumer_id="trainer-0"
        )
        lease_ids = [leased.lease_id for leased in first.groups]
        extended = await buffer.extend_lease(job_id, lease_ids, lease_s=120)
        assert extended.num_extended == 2
        assert extended.lease_expires_unix_ms > first.groups[0].lease_expires_unix_ms
        assert await buffer.release_consumer(job_id, "trainer-0", reason="restarted") == 2
        second = await buffer.pull_batch(job_id, num_groups=2, trainer_version=0, max_staleness=0, lease_s=60)
        assert [(g.group.group_id, g.redelivery_count) for g in second.groups] == [("a", 1), ("b", 1)]
        expected_a = make_group("a")
        expected_a.job_id = job_id  # filled in by the buffer; otherwise the group comes back exactly as pushed
        assert second.groups[0].group == expected_a
        assert await buffer.nack(job_id, [second.groups[0].lease_id], discard=True, reason="poison") == 1
        ack = await buffer.ack(job_id, [second.groups[1].lease_id, *lease_ids])
        assert (ack.num_acked, sorted(ack.expired_lease_ids)) == (1, sorted(lease_ids))
        stats = await buffer.stats(job_id)
        assert (stats.nacked_total, stats.discarded_total, stats.acked_total, stats.pulled_total) == (2, 1, 1, 4)
        assert (stats.queued_groups, stats.leased_groups) == (0, 0)
