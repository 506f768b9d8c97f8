"""The pass-through encoding equals what protobuf itself would build (stored group bytes are never re-parsed)."""

from __future__ import annotations

from collections.abc import Callable

from miles.buffer.convert import pull_response_bytes
from miles.buffer.grpc_api import PushGroupCall
from miles.buffer.records import LeasedRecord, PullResult
from miles.buffer.wire import len_field, top_level_len_field
from miles.proto.buffer.v1 import buffer_pb2
from miles.proto.common.v1 import common_pb2

GroupFactory = Callable[..., common_pb2.Group]


def test_pull_response_bytes_parse_to_the_same_message(make_group: GroupFactory) -> None:
    groups = [make_group(f"g{i}", versions=(i, i + 1), num_response_tokens=300) for i in range(3)]
    result = PullResult(num_dropped_stale=2, num_requeued=1, lease_expires_unix_ms=1_700_000_000_123)
    for index, group in enumerate(groups):
        result.groups.append(
            LeasedRecord(
                lease_id=f"lease-{index}",
                group_bytes=group.SerializeToString(),
                staleness=index,
                redelivery_count=index * 2,
            )
        )
    expected = buffer_pb2.PullBatchResponse(num_dropped_stale=2, num_requeued=1)
    for index, group in enumerate(groups):
        expected.groups.add(
            lease_id=f"lease-{index}",
            group=group,
            staleness=index,
            lease_expires_unix_ms=1_700_000_000_123,
            redelivery_count=index * 2,
        )
    assert buffer_pb2.PullBatchResponse.FromString(pull_response_bytes(result)) == expected


def test_push_call_keeps_the_group_bytes_as_sent(make_group: GroupFactory) -> None:
    group = make_group("g", num_response_tokens=200)
    data = buffer_pb2.PushGroupRequest(job_id="job", group=group, wait_s=2.5).SerializeToString()
    call = PushGroupCall.from_bytes(data)
    assert call.request.job_id == "job"
    assert call.request.wait_s == 2.5
    assert common_pb2.Group.FromString(call.group_bytes) == group


def test_appended_field_sets_job_id_and_split_fields_merge(make_group: GroupFactory) -> None:
    group = make_group("g")
    with_job = common_pb2.Group.FromString(group.SerializeToString() + len_field(2, b"job-7"))
    assert with_job.job_id == "job-7"
    halves = (common_pb2.Group(group_id="g"), common_pb2.Group(prompt_index=9))
    message = b"".join(len_field(2, half.SerializeToString()) for half in halves)
    merged = common_pb2.Group.FromString(top_level_len_field(message, 2))
    assert (merged.group_id, merged.prompt_index) == ("g", 9)
