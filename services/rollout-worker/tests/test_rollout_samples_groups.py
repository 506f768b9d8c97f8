"""Sample and group operations: statuses, per-turn rewards, the `keep` span fold, group filters, and that every
group the worker builds passes the buffer's own validation."""

from __future__ import annotations

from collections.abc import Callable

from miles.buffer.validation import check_group
from miles.common.jobspec.rollout import GroupFilterSpec
from miles.proto.common.v1 import common_pb2
from miles.rollout import samples as sample_ops
from miles.rollout.episode import EpisodeOutcome
from miles.rollout.groups import build_group, filter_reason, group_id_for

SampleFactory = Callable[..., common_pb2.Sample]


def test_placeholders_and_marks_are_valid_aborted_samples() -> None:
    sample = sample_ops.placeholder("g/0", "g")
    sample_ops.mark([sample], sample_ops.ABORTED, "agent_error", "x" * 5000)
    assert sample.status == sample_ops.ABORTED and not sample_ops.is_trainable(sample)
    assert sample.metadata["status_reason"] == "agent_error" and len(sample.metadata["error"]) == 2000
    assert sample_ops.status_name(sample.status) == "ABORTED"
    group = common_pb2.Group(group_id="g", samples=[sample])
    check_group("job", group)


def test_turn_rewards_land_on_the_last_token_of_each_turn(make_sample: SampleFactory) -> None:
    sample = make_sample(turns=(3, 2), gap=2)
    assert sample_ops.put_turn_rewards(sample, [0.5, 1.0])
    assert list(sample.token_rewards) == [0, 0, 0.5, 0, 0, 0, 1.0]
    assert not sample_ops.put_turn_rewards(make_sample(turns=(3,)), [1.0, 2.0]), "one reward per turn"


def test_keep_policy_folds_spans_into_one_at_the_oldest_version(make_sample: SampleFactory) -> None:
    sample = make_sample(turns=(3, 2, 4), gap=1, versions=(4, 5, 5))
    assert sample_ops.weight_versions([sample]) == {4, 5}
    sample_ops.fold_spans_to_oldest(sample)
    spans = [(span.start, span.end, span.weight_version) for span in sample.weight_versions]
    assert spans == [(0, len(sample.loss_mask), 4)]
    check_group("job", common_pb2.Group(group_id="g", samples=[sample]))


def test_group_filters(make_sample: SampleFactory) -> None:
    rewarded = [make_sample(reward=r) for r in (0.0, 1.0)]
    aborted = make_sample(status=sample_ops.ABORTED)
    assert filter_reason(rewarded, GroupFilterSpec()) is None
    assert filter_reason([aborted], GroupFilterSpec()) == "all_aborted"
    assert filter_reason([aborted, rewarded[0]], GroupFilterSpec(min_valid_samples=2)) == "too_few_valid"
    same = [make_sample(reward=1.0), make_sample(reward=1.0), aborted]
    assert filter_reason(same, GroupFilterSpec(drop_equal_rewards=True)) == "equal_rewards"
    assert filter_reason(same, GroupFilterSpec()) is None


def test_groups_are_deterministic_and_valid_for_the_buffer(make_sample: SampleFactory) -> None:
    group_id = group_id_for("job-1", 2, 17)
    assert group_id == group_id_for("job-1", 2, 17) == "job-1/e2/p17"
    outcomes = [
        EpisodeOutcome([make_sample(turns=(2, 3))], sample_ops.COMPLETED, "ok"),
        EpisodeOutcome([sample_ops.placeholder(f"{group_id}/1", group_id)], sample_ops.ABORTED, "timeout"),
    ]
    for outcome in outcomes:
        for sample in outcome.samples:
            sample.group_id = group_id
    group = build_group(
        job_id="job-1",
        group_id=group_id,
        epoch=2,
        prompt_index=17,
        outcomes=outcomes,
        prompt={"messages": [{"role": "user", "content": "hi"}]},
    )
    summary = check_group("job-1", group)
    assert summary is not None and len(group.samples) == 2
    assert group.metadata["episode_reasons"] == {"ok": 1.0, "timeout": 1.0}
    assert group.metadata["messages"][0]["content"] == "hi"
