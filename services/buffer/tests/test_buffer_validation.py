"""Group and request validation names the offending field (pure functions, no Redis)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from miles.buffer.errors import InvalidRequestError
from miles.buffer.validation import check_group, check_job_id, check_pull
from miles.proto.common.v1 import common_pb2

Mutation = Callable[[common_pb2.Group], None]
GroupFactory = Callable[..., common_pb2.Group]


def _clear(field_name: str) -> Mutation:
    return lambda group: group.samples[1].ClearField(field_name)


def _append_mask(group: common_pb2.Group) -> None:
    group.samples[0].loss_mask.append(1)


def _drop_logprob(group: common_pb2.Group) -> None:
    del group.samples[1].rollout_logprobs[-1]


def _span_past_response(group: common_pb2.Group) -> None:
    group.samples[0].weight_versions[0].end = 99


def _overlapping_spans(group: common_pb2.Group) -> None:
    group.samples[0].weight_versions[1].start = 0


def _negative_version(group: common_pb2.Group) -> None:
    group.samples[0].weight_versions[0].weight_version = -1


def _response_start_past_end(group: common_pb2.Group) -> None:
    group.samples[0].response_start = 100


def _no_samples(group: common_pb2.Group) -> None:
    del group.samples[:]


def _no_group_id(group: common_pb2.Group) -> None:
    group.group_id = ""


def _other_job(group: common_pb2.Group) -> None:
    group.job_id = "another-job"


def _short_token_rewards(group: common_pb2.Group) -> None:
    group.samples[0].token_rewards.extend([1.0])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (_no_samples, "group.samples"),
        (_no_group_id, "group.group_id"),
        (_other_job, "group.job_id"),
        (_clear("tokens"), "group.samples[1].tokens"),
        (_append_mask, "group.samples[0].loss_mask"),
        (_drop_logprob, "group.samples[1].rollout_logprobs"),
        (_response_start_past_end, "group.samples[0].response_start"),
        (_span_past_response, "group.samples[0].weight_versions[0]"),
        (_overlapping_spans, "group.samples[0].weight_versions[1]"),
        (_negative_version, "group.samples[0].weight_versions[0].weight_version"),
        (_short_token_rewards, "group.samples[0].token_rewards"),
        (_clear("status"), "group.samples[1].status"),
    ],
    ids=lambda value: value if isinstance(value, str) else getattr(value, "__name__", "clear"),
)
def test_invalid_group_is_rejected_naming_the_field(mutate: Mutation, field: str, make_group: GroupFactory) -> None:
    group = make_group("g", versions=(1, 2))
    mutate(group)
    with pytest.raises(InvalidRequestError) as caught:
        check_group("job", group)
    assert caught.value.field == field


def test_valid_group_summary_counts_trainable_samples_and_oldest_version(make_group: GroupFactory) -> None:
    group = make_group(
        "g", versions=(4, 2), num_samples=3, rewards=(1.0, 1.0, 0.0), statuses=(1, 2, common_pb2.SAMPLE_STATUS_ABORTED)
    )
    summary = check_group("job", group)
    assert summary.min_weight_version == 2
    assert summary.num_samples == 3
    assert summary.num_tokens == 3 * 8
    assert summary.num_trainable == 2
    assert summary.trainable_rewards_equal is True


def test_group_without_spans_has_no_version(make_group: GroupFactory) -> None:
    group = make_group("g")
    for sample in group.samples:
        sample.ClearField("weight_versions")
    assert check_group("job", group).min_weight_version == -1


@pytest.mark.parametrize("job_id", ["", "has space", "a{b}", "x" * 201])
def test_bad_job_id_is_rejected(job_id: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_job_id(job_id)
    assert caught.value.field == "job_id"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_groups": 0}, "num_groups"),
        ({"min_groups": 5}, "min_groups"),
        ({"trainer_version": -1}, "trainer_version"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"lease_s": 0.0}, "lease_s"),
        ({"lease_s": float("nan")}, "lease_s"),
        ({"wait_s": -1.0}, "wait_s"),
    ],
)
def test_bad_pull_arguments_name_the_field(overrides: dict[str, float], field: str) -> None:
    arguments = {
        "num_groups": 4,
        "min_groups": 0,
        "trainer_version": 3,
        "max_staleness": 1,
        "lease_s": 10.0,
        "wait_s": 0.0,
        "max_pull_groups": 64,
        "max_lease_s": 100.0,
        **overrides,
    }
    with pytest.raises(InvalidRequestError) as caught:
        check_pull(**arguments)  # type: ignore[arg-type]
    assert caught.value.field == field
