"""Group validation (each bad input maps to one reason), packing plans and statistics merging."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from miles.proto.common.v1 import common_pb2
from miles.trainer.batch import BadGroupError, group_staleness, samples_from_group
from miles.trainer.packing import pack_micro_batches, plan_micro_batches, shard_over_ranks
from miles.trainer.stats import StepStats, merge_all

Corrupt = Callable[[common_pb2.Sample], None]
GroupFactory = Callable[..., common_pb2.Group]


def _check(group: common_pb2.Group) -> None:
    samples_from_group(group, 0, vocab_size=512, max_positions=64)


def test_valid_group_becomes_samples_with_versions(make_group: GroupFactory) -> None:
    group = make_group("g", num_samples=3, version=4)
    samples = samples_from_group(group, 2, vocab_size=512, max_positions=64)
    assert [s.sample_id for s in samples] == ["g/0", "g/1", "g/2"]
    assert all(s.min_version == 4 and s.max_version == 4 and s.group_index == 2 for s in samples)
    assert group_staleness(samples, 6) == 2
    assert group_staleness(samples, 3) == 0


@pytest.mark.parametrize(
    ("reason", "corrupt"),
    [
        ("misaligned", lambda s: s.loss_mask.append(1)),
        ("misaligned", lambda s: s.rollout_logprobs.pop()),
        ("misaligned", lambda s: setattr(s, "response_start", 99)),
        ("misaligned", lambda s: s.token_rewards.extend([0.0])),
        ("unknown_status", lambda s: setattr(s, "status", 17)),
        ("unknown_status", lambda s: setattr(s, "status", common_pb2.SAMPLE_STATUS_UNSPECIFIED)),
        ("bad_loss_mask", lambda s: s.loss_mask.__setitem__(0, 2)),
        ("bad_spans", lambda s: s.weight_versions.add(start=2, end=9, weight_version=0)),
        ("token_out_of_range", lambda s: s.tokens.__setitem__(0, 512)),
        ("token_out_of_range", lambda s: s.tokens.__setitem__(0, -1)),
        ("non_finite", lambda s: s.rollout_logprobs.__setitem__(1, math.nan)),
        ("non_finite", lambda s: setattr(s, "reward", math.inf)),
        (
            "too_long",
            lambda s: (s.tokens.extend([1] * 60), s.loss_mask.extend([1] * 60), s.rollout_logprobs.extend([0.0] * 60)),
        ),
        (
            "empty_prompt",
            lambda s: (
                setattr(s, "response_start", 0),
                s.loss_mask.extend([1] * 4),
                s.rollout_logprobs.extend([0.0] * 4),
            ),
        ),
    ],
)
def test_each_bad_input_is_rejected_with_its_reason(reason: str, corrupt: Corrupt, make_group: GroupFactory) -> None:
    group = make_group("g")
    corrupt(group.samples[1])
    with pytest.raises(BadGroupError) as caught:
        _check(group)
    assert caught.value.reason == reason
    assert "samples[1]" in caught.value.message or reason == "empty_group"


def test_empty_group_is_rejected() -> None:
    with pytest.raises(BadGroupError, match="empty_group"):
        _check(common_pb2.Group(group_id="g"))


def test_aborted_samples_are_kept_untrainable_without_value_checks(make_group: GroupFactory) -> None:
    group = make_group("g")
    group.samples[0].status = common_pb2.SAMPLE_STATUS_ABORTED
    group.samples[0].tokens[0] = 10_000  # not checked: an aborted sample is never forwarded
    samples = samples_from_group(group, 0, vocab_size=512, max_positions=64)
    assert [s.trainable for s in samples] == [False, True]


def test_aborted_samples_are_still_held_to_the_sample_contract(make_group: GroupFactory) -> None:
    """The shared shape check (miles.common.contracts.samples) runs on every sample, as at the buffer."""
    group = make_group("g")
    group.samples[0].status = common_pb2.SAMPLE_STATUS_ABORTED
    group.samples[0].weight_versions.add(start=0, end=99, weight_version=1)
    with pytest.raises(BadGroupError) as caught:
        _check(group)
    assert caught.value.reason == "bad_spans" and "samples[0].weight_versions" in caught.value.message


def test_packing_respects_the_budget_and_keeps_every_sequence_once() -> None:
    sizes = [7, 3, 9, 2, 5, 12, 1]
    bins = pack_micro_batches(sizes, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 or len(b) == 1 for b in bins)
    assert [12] in [[sizes[i] for i in b] for b in bins]  # oversized alone
    # first-fit decreasing: 12 | 9+1 | 7+3 | 5+2
    assert sorted(sorted(sizes[i] for i in b) for b in bins) == [[1, 9], [2, 5], [3, 7], [12]]
    assert pack_micro_batches(sizes, 10) == bins  # deterministic


def test_sharding_balances_tokens_over_ranks() -> None:
    sizes = [10, 9, 8, 1, 1, 1]
    shards = shard_over_ranks(sizes, 2)
    loads = [sum(sizes[i] for i in shard) for shard in shards]
    assert sorted(i for s in shards for i in s) == list(range(6))
    assert loads == [13, 17]  # largest first to the lighter rank: 10 | 9, 8 -> rank 1 (9 < 10), 1s -> rank 0
    plan = plan_micro_batches(sizes, 11, 2)
    assert len(plan) == 2 and all(len(rank) >= 1 for rank in plan)


def test_step_stats_merge_means_extremes_and_totals() -> None:
    first, second = StepStats(), StepStats()
    first.add_mean("x", 3.0, 2)
    first.add_max("x_max", 5.0)
    first.add_total("loss", 0.25)
    second.add_mean("x", 5.0, 2)
    second.add_max("x_max", 4.0)
    second.add_min("x_min", -1.0)
    second.add_total("loss", 0.5)
    merged = merge_all([first, StepStats.from_dict(second.to_dict())]).result()
    assert merged == {"loss": 0.75, "x": 2.0, "x_max": 5.0, "x_min": -1.0}
