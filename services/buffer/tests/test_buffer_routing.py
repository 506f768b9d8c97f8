"""Routing (R3, `Sample.rollout_routed_experts`) at the buffer: a group whose routing is malformed or
inconsistent is refused naming the sample and field, and stores nothing; a valid group's routing bytes come back
from a pull exactly as they were pushed, through the Redis store and through a real miles-buffer over gRPC."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
import pytest

from miles.buffer.core import Buffer
from miles.buffer.errors import InvalidRequestError
from miles.buffer.records import JobConfig
from miles.buffer.validation import check_group
from miles.common.contracts.routing import RoutingShape, pack, unpack
from miles.common.errors import InvalidArgumentError
from miles.proto.buffer.v1 import buffer_pb2, buffer_pb2_grpc
from miles.proto.common.v1 import common_pb2

if TYPE_CHECKING:
    from conftest import BufferProcess

GroupFactory = Callable[..., common_pb2.Group]
Mutation = Callable[[common_pb2.Group], None]
SHAPE = RoutingShape(num_layers=3, top_k=2, num_experts=16)  # uint8 ids: 6 bytes per token position
WIDE_SHAPE = RoutingShape(num_layers=3, top_k=2, num_experts=300)  # uint16 ids
ABORTED = common_pb2.SAMPLE_STATUS_ABORTED
LONG_LEASE_S = 60.0


def _route(sample: common_pb2.Sample, shape: RoutingShape = SHAPE, *, seed: int = 0) -> None:
    """Routing for every position but the last, ids varying by position, layer and slot (so a reordered or
    truncated copy differs)."""
    rows = len(sample.tokens) - 1
    ids = [(seed + 7 * row + 3 * slot) % shape.num_experts for row in range(rows) for slot in range(shape.row_width)]
    sample.rollout_routed_experts.CopyFrom(pack(ids, shape))


def routed_group(make_group: GroupFactory, group_id: str = "g-routed", **kwargs: object) -> common_pb2.Group:
    group = make_group(group_id, versions=(1, 2), **kwargs)
    for index, sample in enumerate(group.samples):
        _route(sample, seed=index)
    return group


def _truncate_data(group: common_pb2.Group) -> None:
    routed = group.samples[1].rollout_routed_experts
    routed.data = routed.data[:-1]


def _other_layer_count(group: common_pb2.Group) -> None:
    _route(group.samples[1], RoutingShape(num_layers=2, top_k=2, num_experts=16))


def _other_top_k(group: common_pb2.Group) -> None:
    _route(group.samples[1], RoutingShape(num_layers=3, top_k=1, num_experts=16))


def _other_dtype(group: common_pb2.Group) -> None:
    _route(group.samples[1], WIDE_SHAPE)


def _one_trainable_without(group: common_pb2.Group) -> None:
    group.samples[1].ClearField("rollout_routed_experts")


def _unknown_dtype(group: common_pb2.Group) -> None:
    group.samples[0].rollout_routed_experts.dtype = common_pb2.ROUTING_DTYPE_UNSPECIFIED


REFUSED = [
    (_truncate_data, "group.samples[1].rollout_routed_experts.data", "need len(tokens) - 1 = 7 rows"),
    (_other_layer_count, "group.samples[1].rollout_routed_experts.num_layers", "is 2 but group.samples[0] has 3"),
    (_other_top_k, "group.samples[1].rollout_routed_experts.top_k", "is 1 but group.samples[0] has 2"),
    (
        _other_dtype,
        "group.samples[1].rollout_routed_experts.dtype",
        "is ROUTING_DTYPE_UINT16 but group.samples[0] has ROUTING_DTYPE_UINT8",
    ),
    (_one_trainable_without, "group.samples[1].rollout_routed_experts", "missing but group.samples[0] has routing"),
    (_unknown_dtype, "group.samples[0].rollout_routed_experts.dtype", "not a known RoutingDtype"),
]
REFUSED_IDS = ["bad_length", "layer_count", "top_k", "dtype", "mixed_group", "unknown_dtype"]


@pytest.mark.parametrize(("mutate", "field", "reason"), REFUSED, ids=REFUSED_IDS)
def test_inconsistent_routing_is_refused_naming_sample_and_field(
    make_group: GroupFactory, mutate: Mutation, field: str, reason: str
) -> None:
    group = routed_group(make_group, num_samples=3)
    check_group("job", group)  # valid before the mutation
    mutate(group)
    with pytest.raises(InvalidRequestError) as refused:
        check_group("job", group)
    assert refused.value.field == field
    assert refused.value.message.startswith(field)
    assert reason in refused.value.message


def test_samples_not_trained_on_may_lack_routing_but_not_differ_in_shape(make_group: GroupFactory) -> None:
    """An aborted episode may end before the engine answered its routing; it still comes from the same model."""
    group = routed_group(make_group, num_samples=3, statuses=[common_pb2.SAMPLE_STATUS_COMPLETED, ABORTED, ABORTED])
    group.samples[1].ClearField("rollout_routed_experts")
    assert check_group("job", group).num_trainable == 1
    _route(group.samples[2], RoutingShape(num_layers=4, top_k=2, num_experts=16))
    with pytest.raises(InvalidRequestError) as refused:
        check_group("job", group)
    assert refused.value.field == "group.samples[2].rollout_routed_experts.num_layers"


def test_routing_only_on_an_aborted_sample_is_not_a_mixed_group(make_group: GroupFactory) -> None:
    group = make_group("g", num_samples=2, statuses=[common_pb2.SAMPLE_STATUS_COMPLETED, ABORTED])
    _route(group.samples[1])
    assert check_group("job", group).num_samples == 2


async def test_refused_routing_stores_nothing_and_valid_routing_round_trips_through_redis(
    buffer_core: Buffer, make_group: GroupFactory
) -> None:
    await buffer_core.configure_job("j", JobConfig(capacity_groups=8))
    bad = routed_group(make_group, "g-bad")
    _other_layer_count(bad)
    with pytest.raises(InvalidRequestError):
        await buffer_core.push_group("j", bad, wait_s=0)
    stats = await buffer_core.stats("j")
    assert (stats.counter("pushed"), stats.queued_groups) == (0, 0)

    pushed = routed_group(make_group, "g-ok")
    pushed.job_id = "j"
    assert (await buffer_core.push_group("j", pushed, wait_s=0)).outcome == "queued"
    pulled = await buffer_core.pull_batch("j", num_groups=4, trainer_version=2, max_staleness=1, lease_s=LONG_LEASE_S)
    (record,) = pulled.groups
    assert record.group_bytes == pushed.SerializeToString()
    group = common_pb2.Group.FromString(record.group_bytes)
    for mine, theirs in zip(pushed.samples, group.samples, strict=True):
        assert theirs.rollout_routed_experts == mine.rollout_routed_experts
        assert unpack(theirs.rollout_routed_experts) == unpack(mine.rollout_routed_experts)


@pytest.mark.integration
@pytest.mark.parametrize(("mutate", "field", "reason"), [*REFUSED[:2], REFUSED[4]], ids=["length", "layers", "mixed"])
async def test_push_of_bad_routing_is_invalid_argument_with_field_and_reason(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str, mutate: Mutation, field: str, reason: str
) -> None:
    group = routed_group(make_group)
    mutate(group)
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=8)
        async with grpc.aio.insecure_channel(shared_buffer.target) as channel:
            stub = buffer_pb2_grpc.BufferServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as raw:
                await stub.PushGroup(buffer_pb2.PushGroupRequest(job_id=job_id, group=group), timeout=10)
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("miles-error-field", field) in tuple(raw.value.trailing_metadata() or ())
        assert reason in (raw.value.details() or "")
        with pytest.raises(InvalidArgumentError) as typed:
            await buffer.push_group(job_id, group)
        assert typed.value.field == field
        stats = await buffer.stats(job_id)
        assert (stats.pushed_total, stats.queued_groups) == (0, 0)


@pytest.mark.integration
async def test_routing_bytes_survive_push_and_pull_over_grpc_bit_exact(
    shared_buffer: BufferProcess, make_group: GroupFactory, job_id: str
) -> None:
    uint8_group = routed_group(make_group, "g-uint8", num_samples=3, num_response_tokens=40)
    uint16_group = make_group("g-uint16", versions=(1, 2), num_samples=2)
    for index, sample in enumerate(uint16_group.samples):
        _route(sample, WIDE_SHAPE, seed=250 + index)  # ids above 255: a narrowing bug would change them
    async with shared_buffer.client() as buffer:
        await buffer.configure_job(job_id, capacity_groups=8)
        for group in (uint8_group, uint16_group):
            group.job_id = job_id
            assert (await buffer.push_group(job_id, group)).outcome == buffer_pb2.PUSH_OUTCOME_QUEUED
        batch = await buffer.pull_batch(job_id, num_groups=4, trainer_version=2, max_staleness=1, lease_s=30)
    assert [leased.group for leased in batch.groups] == [uint8_group, uint16_group]
    for leased, pushed in zip(batch.groups, (uint8_group, uint16_group), strict=True):
        assert leased.group.SerializeToString() == pushed.SerializeToString()
        datas = [sample.rollout_routed_experts.data for sample in leased.group.samples]
        assert datas == [sample.rollout_routed_experts.data for sample in pushed.samples]
    assert max(unpack(batch.groups[1].group.samples[1].rollout_routed_experts)) > 255
