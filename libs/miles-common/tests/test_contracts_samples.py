"""The Sample contract: each broken invariant is reported once, with its kind and the field it is about."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from miles.common.contracts.samples import KNOWN_STATUSES, TRAINABLE_STATUSES, SampleProblem, sample_problem
from miles.proto.common.v1 import common_pb2

Mutation = Callable[[common_pb2.Sample], object]
SPAN_1 = "weight_versions[1]"


def valid_sample() -> common_pb2.Sample:
    """8 tokens, 4 of them response, two turns of 2 tokens at versions 3 and 4 with a token reward each."""
    sample = common_pb2.Sample(
        sample_id="s",
        tokens=[1, 2, 3, 4, 5, 6, 7, 8],
        response_start=4,
        loss_mask=[1, 1, 0, 1],
        rollout_logprobs=[-0.5, -0.25, 0.0, -1.0],
        token_rewards=[0.0, 1.0, 0.0, 1.0],
        status=common_pb2.SAMPLE_STATUS_COMPLETED,
    )
    sample.weight_versions.add(start=0, end=2, weight_version=3)
    sample.weight_versions.add(start=3, end=4, weight_version=4)
    return sample


def test_a_valid_sample_has_no_problem() -> None:
    assert sample_problem(valid_sample()) is None


def test_spans_and_token_rewards_are_optional_and_an_empty_response_is_valid() -> None:
    placeholder = common_pb2.Sample(tokens=[0], response_start=1, status=common_pb2.SAMPLE_STATUS_ABORTED)
    assert sample_problem(placeholder) is None
    prompt_only = common_pb2.Sample(tokens=[5, 6], response_start=0, loss_mask=[0, 0], rollout_logprobs=[0.0, 0.0])
    prompt_only.status = common_pb2.SAMPLE_STATUS_FAILED
    assert sample_problem(prompt_only) is None


@pytest.mark.parametrize(
    ("mutate", "kind", "field"),
    [
        (lambda s: s.ClearField("tokens"), "misaligned", "tokens"),
        (lambda s: setattr(s, "response_start", 9), "misaligned", "response_start"),
        (lambda s: setattr(s, "response_start", -1), "misaligned", "response_start"),
        (lambda s: s.loss_mask.append(1), "misaligned", "loss_mask"),
        (lambda s: s.rollout_logprobs.pop(), "misaligned", "rollout_logprobs"),
        (lambda s: s.token_rewards.pop(), "misaligned", "token_rewards"),
        (lambda s: s.ClearField("status"), "unknown_status", "status"),
        (lambda s: setattr(s, "status", 17), "unknown_status", "status"),
        (lambda s: setattr(s.weight_versions[1], "start", 1), "bad_spans", "weight_versions[1]"),
        (lambda s: setattr(s.weight_versions[0], "end", 5), "bad_spans", "weight_versions[0]"),
        (lambda s: setattr(s.weight_versions[0], "end", 0), "bad_spans", "weight_versions[0]"),
        (lambda s: setattr(s.weight_versions[1], "weight_version", -1), "bad_spans", f"{SPAN_1}.weight_version"),
    ],
)
def test_each_broken_invariant_names_its_kind_and_field(mutate: Mutation, kind: str, field: str) -> None:
    sample = valid_sample()
    mutate(sample)
    problem = sample_problem(sample)
    assert isinstance(problem, SampleProblem)
    assert (problem.kind, problem.field) == (kind, field)
    assert problem.message.startswith(field.split(".")[0]), problem.message  # callers prefix it with their path


def test_spans_are_checked_whatever_the_status() -> None:
    sample = valid_sample()
    sample.status = common_pb2.SAMPLE_STATUS_ABORTED
    sample.weight_versions[0].end = 99
    problem = sample_problem(sample)
    assert problem is not None and problem.kind == "bad_spans"


def test_values_are_not_checked() -> None:
    """Per-token values (ids, mask values, finite logprobs) are the trainer's to judge against its model."""
    sample = valid_sample()
    sample.tokens[0] = -5
    sample.loss_mask[0] = 7
    sample.rollout_logprobs[0] = float("nan")
    sample.reward = float("inf")
    assert sample_problem(sample) is None


def test_trainable_statuses_are_completed_and_truncated_of_the_known_ones() -> None:
    trainable = {common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED}
    every_set_status = set(common_pb2.SampleStatus.values()) - {common_pb2.SAMPLE_STATUS_UNSPECIFIED}
    assert trainable == TRAINABLE_STATUSES
    assert every_set_status == KNOWN_STATUSES
