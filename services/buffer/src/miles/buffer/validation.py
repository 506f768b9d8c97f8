"""Request validation of the buffer: every check names the offending field and runs before anything is stored.

Checks are about shape (lengths, ranges, span layout, status, routing byte length: the Sample contract of
miles.common.contracts.samples, the same check the session server and the trainer run; then the group-level
consistency of routing), never per-token values: those would cost a Python-level pass over every token of every
sample (milliseconds per group) and are the trainer's to judge (it nacks groups it cannot train on; expert ids
against its model included).

Also summarises a valid group into the few numbers the store needs (staleness, sizes, filter facts), so that
the Lua scripts never parse protobuf.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from miles.buffer.errors import InvalidRequestError
from miles.common.contracts.samples import TRAINABLE_STATUSES, sample_problem
from miles.proto.common.v1 import common_pb2

_JOB_ID_RE = re.compile(r"^[^\s{}]{1,200}$")
MAX_LEASE_IDS_PER_CALL = 100_000


@dataclass(frozen=True)
class GroupSummary:
    """What the store keeps about a valid group besides its bytes.

    `min_weight_version` / `max_weight_version` are the oldest / newest span version over all samples (-1 when no
    sample has spans: such a group is never stale); `trainable_rewards_equal` is true when every COMPLETED/TRUNCATED
    sample has the same reward.
    """

    min_weight_version: int
    num_samples: int
    num_tokens: int
    num_trainable: int
    trainable_rewards_equal: bool
    max_weight_version: int = -1


def check_job_id(job_id: str) -> None:
    if not _JOB_ID_RE.match(job_id):
        raise InvalidRequestError(
            "job_id must be 1-200 characters without whitespace, '{' or '}'" if job_id else "job_id is empty",
            field="job_id",
        )


def _check_sample(sample: common_pb2.Sample, field: str, group_id: str) -> int:
    """Checks one sample (the shared Sample contract, then what the buffer adds); returns its smallest span
    version (-1 when it has none)."""
    problem = sample_problem(sample)
    if problem is not None:
        raise InvalidRequestError(f"{field}.{problem.message}", field=f"{field}.{problem.field}")
    if sample.group_id and sample.group_id != group_id:
        raise InvalidRequestError(
            f"{field}.group_id {sample.group_id!r} differs from group.group_id {group_id!r}", field=f"{field}.group_id"
        )
    if not math.isfinite(sample.reward):
        raise InvalidRequestError(f"{field}.reward must be finite", field=f"{field}.reward")
    return min((span.weight_version for span in sample.weight_versions), default=-1)


def _check_group_routing(samples: Sequence[common_pb2.Sample]) -> None:
    """Routing (R3) is consistent across the group: every sample that has it has the same shape (num_layers,
    top_k, dtype: one model produced the group), and either every trainable sample has it or none does. A mixed
    group is a producer bug (routing lost for some episodes): the trainer would have to refuse it or train some
    samples without replay. ABORTED/FAILED samples may lack it (they are not trained on). O(samples): compares
    headers only; the byte lengths were checked per sample."""
    reference_index = trainable_with = trainable_without = -1
    for index, sample in enumerate(samples):
        trainable = sample.status in TRAINABLE_STATUSES
        if not sample.HasField("rollout_routed_experts"):
            if trainable and trainable_without < 0:
                trainable_without = index
            continue
        if trainable and trainable_with < 0:
            trainable_with = index
        if reference_index < 0:
            reference_index = index
        else:
            _check_same_routing_shape(samples[reference_index], reference_index, sample, index)
    if trainable_with >= 0 and trainable_without >= 0:
        field = f"group.samples[{trainable_without}].rollout_routed_experts"
        raise InvalidRequestError(
            f"{field} is missing but group.samples[{trainable_with}] has routing: either every trainable "
            "(COMPLETED/TRUNCATED) sample of a group carries routing or none does",
            field=field,
        )


def _check_same_routing_shape(
    reference: common_pb2.Sample, reference_index: int, sample: common_pb2.Sample, index: int
) -> None:
    expected = reference.rollout_routed_experts
    routed = sample.rollout_routed_experts
    differences = {
        "num_layers": (routed.num_layers, expected.num_layers),
        "top_k": (routed.top_k, expected.top_k),
        "dtype": (common_pb2.RoutingDtype.Name(routed.dtype), common_pb2.RoutingDtype.Name(expected.dtype)),
    }
    for name, (value, wanted) in differences.items():
        if value != wanted:
            field = f"group.samples[{index}].rollout_routed_experts.{name}"
            raise InvalidRequestError(
                f"{field} is {value} but group.samples[{reference_index}] has {wanted}: every sample of a group "
                "carries routing of the same shape (one model produced them)",
                field=field,
            )


def check_group(job_id: str, group: common_pb2.Group) -> GroupSummary:
    """Validates a pushed group (see PushGroupRequest in buffer.proto) and summarises it."""
    if not group.group_id:
        raise InvalidRequestError("group.group_id is empty", field="group.group_id")
    if group.job_id and group.job_id != job_id:
        raise InvalidRequestError(f"group.job_id {group.job_id!r} differs from job_id {job_id!r}", field="group.job_id")
    if not group.samples:
        raise InvalidRequestError("group.samples is empty: a group has at least one sample", field="group.samples")
    if group.epoch < 0:
        raise InvalidRequestError("group.epoch must be >= 0", field="group.epoch")
    min_version = -1
    max_version = max((span.weight_version for s in group.samples for span in s.weight_versions), default=-1)
    num_tokens = 0
    trainable_rewards: list[float] = []
    for index, sample in enumerate(group.samples):
        sample_min = _check_sample(sample, f"group.samples[{index}]", group.group_id)
        if sample_min >= 0:
            min_version = sample_min if min_version < 0 else min(min_version, sample_min)
        num_tokens += len(sample.tokens)
        if sample.status in TRAINABLE_STATUSES:
            trainable_rewards.append(sample.reward)
    _check_group_routing(group.samples)
    return GroupSummary(
        min_weight_version=min_version,
        num_samples=len(group.samples),
        num_tokens=num_tokens,
        num_trainable=len(trainable_rewards),
        trainable_rewards_equal=len(set(trainable_rewards)) <= 1,
        max_weight_version=max_version,
    )


def check_lease_ids(lease_ids: Sequence[str], *, allow_empty: bool = False) -> None:
    if not lease_ids and not allow_empty:
        raise InvalidRequestError("lease_ids is empty", field="lease_ids")
    if len(lease_ids) > MAX_LEASE_IDS_PER_CALL:
        raise InvalidRequestError(f"at most {MAX_LEASE_IDS_PER_CALL} lease_ids per call", field="lease_ids")
    if any(not lease_id for lease_id in lease_ids):
        raise InvalidRequestError("lease_ids contains an empty id", field="lease_ids")


def check_lease_s(lease_s: float, max_lease_s: float) -> None:
    if not 0 < lease_s <= max_lease_s:
        raise InvalidRequestError(f"lease_s must be in (0, {max_lease_s:g}], got {lease_s}", field="lease_s")


def check_pull(
    *,
    num_groups: int,
    min_groups: int,
    trainer_version: int,
    max_staleness: int,
    lease_s: float,
    wait_s: float,
    max_pull_groups: int,
    max_lease_s: float,
) -> None:
    """Validates the arguments of PullBatch (see PullBatchRequest in buffer.proto)."""
    if not 1 <= num_groups <= max_pull_groups:
        raise InvalidRequestError(f"num_groups must be in [1, {max_pull_groups}], got {num_groups}", field="num_groups")
    if not 0 <= min_groups <= num_groups:
        raise InvalidRequestError(f"min_groups must be in [0, num_groups], got {min_groups}", field="min_groups")
    if trainer_version < 0:
        raise InvalidRequestError(f"trainer_version must be >= 0, got {trainer_version}", field="trainer_version")
    if max_staleness < 0:
        raise InvalidRequestError(f"max_staleness must be >= 0, got {max_staleness}", field="max_staleness")
    check_lease_s(lease_s, max_lease_s)
    if not (wait_s >= 0 and math.isfinite(wait_s)):
        raise InvalidRequestError(f"wait_s must be a finite number >= 0, got {wait_s}", field="wait_s")
