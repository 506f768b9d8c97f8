"""Conversions between the buffer's records and its protobuf messages, including the pass-through encoding of
PullBatch responses (stored group bytes spliced in, see wire.py)."""

from __future__ import annotations

from miles.buffer.errors import InvalidRequestError
from miles.buffer.records import GroupFilter, JobConfig, JobStats, PullResult, StalePolicy
from miles.buffer.wire import len_field
from miles.proto.buffer.v1 import buffer_pb2

_RESPONSE_GROUPS_FIELD = buffer_pb2.PullBatchResponse.DESCRIPTOR.fields_by_name["groups"].number
_LEASED_GROUP_FIELD = buffer_pb2.LeasedGroup.DESCRIPTOR.fields_by_name["group"].number

_STALE_POLICY_FROM_PROTO: dict[int, StalePolicy] = {
    buffer_pb2.STALE_POLICY_UNSPECIFIED: "drop",
    buffer_pb2.STALE_POLICY_DROP: "drop",
    buffer_pb2.STALE_POLICY_REQUEUE: "requeue",
    buffer_pb2.STALE_POLICY_MASK: "mask",
}
_STALE_POLICY_TO_PROTO = {
    "drop": buffer_pb2.STALE_POLICY_DROP,
    "requeue": buffer_pb2.STALE_POLICY_REQUEUE,
    "mask": buffer_pb2.STALE_POLICY_MASK,
}
_GROUP_FILTER_FROM_PROTO: dict[int, GroupFilter] = {
    buffer_pb2.GROUP_FILTER_UNSPECIFIED: "none",
    buffer_pb2.GROUP_FILTER_NONE: "none",
    buffer_pb2.GROUP_FILTER_DROP_EQUAL_REWARDS: "drop_equal_rewards",
}
_GROUP_FILTER_TO_PROTO = {
    "none": buffer_pb2.GROUP_FILTER_NONE,
    "drop_equal_rewards": buffer_pb2.GROUP_FILTER_DROP_EQUAL_REWARDS,
}
PUSH_OUTCOME_TO_PROTO = {
    "queued": buffer_pb2.PUSH_OUTCOME_QUEUED,
    "duplicate": buffer_pb2.PUSH_OUTCOME_DUPLICATE,
    "rejected_all_aborted": buffer_pb2.PUSH_OUTCOME_REJECTED_ALL_ABORTED,
    "filtered": buffer_pb2.PUSH_OUTCOME_FILTERED,
}


def config_to_proto(config: JobConfig) -> buffer_pb2.JobBufferConfig:
    return buffer_pb2.JobBufferConfig(
        capacity_groups=config.capacity_groups,
        stale_policy=_STALE_POLICY_TO_PROTO[config.stale_policy],
        group_filter=_GROUP_FILTER_TO_PROTO[config.group_filter],
        min_valid_samples=config.min_valid_samples,
    )


def config_from_proto(config: buffer_pb2.JobBufferConfig) -> JobConfig:
    if config.stale_policy not in _STALE_POLICY_FROM_PROTO:
        raise InvalidRequestError("config.stale_policy is not a known StalePolicy", field="config.stale_policy")
    if config.group_filter not in _GROUP_FILTER_FROM_PROTO:
        raise InvalidRequestError("config.group_filter is not a known GroupFilter", field="config.group_filter")
    return JobConfig(
        capacity_groups=config.capacity_groups,
        stale_policy=_STALE_POLICY_FROM_PROTO[config.stale_policy],
        group_filter=_GROUP_FILTER_FROM_PROTO[config.group_filter],
        min_valid_samples=config.min_valid_samples,
    )


def stats_to_proto(stats: JobStats) -> buffer_pb2.StatsResponse:
    return buffer_pb2.StatsResponse(
        queued_groups=stats.queued_groups,
        queued_samples=stats.queued_samples,
        queued_tokens=stats.queued_tokens,
        leased_groups=stats.leased_groups,
        pushed_total=stats.counter("pushed"),
        duplicate_pushes_total=stats.counter("duplicate"),
        pulled_total=stats.counter("pulled"),
        acked_total=stats.counter("acked"),
        nacked_total=stats.counter("nacked"),
        expired_leases_total=stats.counter("expired"),
        dropped_stale_total=stats.counter("dropped_stale"),
        requeued_total=stats.counter("requeued"),
        stale_masked_total=stats.counter("stale_masked"),
        filtered_total=stats.filtered_total,
        rejected_aborted_total=stats.counter("rejected_aborted"),
        avg_staleness=stats.avg_staleness,
        max_staleness=stats.counter("staleness_max"),
        oldest_group_age_s=stats.oldest_group_age_s,
        capacity_groups=stats.config.capacity_groups,
        discarded_total=stats.counter("discarded"),
        requeued_pending=stats.requeued_pending,
        config=config_to_proto(stats.config),
    )


def pull_response_bytes(result: PullResult) -> bytes:
    """The serialized PullBatchResponse for `result`, each stored group spliced in as it is (no parse)."""
    parts = [
        buffer_pb2.PullBatchResponse(
            num_dropped_stale=result.num_dropped_stale, num_requeued=result.num_requeued
        ).SerializeToString()
    ]
    for record in result.groups:
        leased = buffer_pb2.LeasedGroup(
            lease_id=record.lease_id,
            staleness=record.staleness,
            lease_expires_unix_ms=result.lease_expires_unix_ms,
            redelivery_count=record.redelivery_count,
        ).SerializeToString()
        parts.append(len_field(_RESPONSE_GROUPS_FIELD, leased + len_field(_LEASED_GROUP_FIELD, record.group_bytes)))
    return b"".join(parts)
