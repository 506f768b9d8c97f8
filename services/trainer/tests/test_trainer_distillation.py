"""On-policy distillation in the trainer: per-token advantages from the teacher's logprobs, pinned by hand, their
place in the flattened batch, and the samples a distillation job refuses."""

from __future__ import annotations

import pytest

from miles.common.jobspec.distillation import DistillationConfig
from miles.common.jobspec.trainer import TrainConfig
from miles.proto.common.v1 import common_pb2
from miles.trainer.batch import BadGroupError, TrainSample, samples_from_group
from miles.trainer.distillation import BASELINE_EPS, apply_distillation
from miles.trainer.microbatch import flatten
from miles.trainer.step import has_signal


def sample(mask: list[int], rollout: list[float], teacher: list[float] | None, advantage: float) -> TrainSample:
    n = len(mask)
    return TrainSample(
        group_id="g",
        sample_id=f"s{advantage}",
        group_index=0,
        tokens=list(range(1, n + 3)),
        response_start=2,
        loss_mask=mask,
        rollout_logprobs=rollout,
        reward=0.0,
        trainable=True,
        min_version=0,
        max_version=0,
        advantage=advantage,
        teacher_logprobs=teacher,
    )


def test_token_advantages_are_the_teacher_minus_student_logprob_plus_the_weighted_reward_advantage() -> None:
    first = sample([1, 0, 1], [-1.0, -9.0, -0.5], [-0.25, -2.0, -1.5], advantage=0.5)
    second = sample([1, 1], [-2.0, -0.125], [-1.0, -0.125], advantage=-1.0)
    stats = apply_distillation(
        [first, second], DistillationConfig(teacher_pool="t", kl_coef=2.0, reward_weight=0.5, discount=0.0)
    )
    # first: 2 * (-0.25 + 1.0) + 0.25 = 1.75; masked: 0; 2 * (-1.5 + 0.5) + 0.25 = -1.75
    assert first.token_advantages == [1.75, 0.0, -1.75]
    # second: 2 * (-1.0 + 2.0) - 0.5 = 1.5; 2 * 0 - 0.5 = -0.5
    assert second.token_advantages == [1.5, -0.5]
    # reverse KL (student - teacher) over the 4 loss tokens: (-0.75 + 1.0 - 1.0 + 0.0) / 4
    assert stats["distill_reverse_kl_mean"] == pytest.approx(-0.1875)
    assert stats["distill_advantage_mean"] == pytest.approx((1.75 - 1.75 + 1.5 - 0.5) / 4)
    flat = flatten([first, second], trainer_version=0)
    assert flat.advantages.tolist() == [1.75, 0.0, -1.75, 1.5, -0.5]


def test_a_discount_turns_the_distillation_term_into_its_reward_to_go_over_loss_tokens() -> None:
    """d = teacher - student per loss token; with discount g each token gets d_t + g * (next loss token's value),
    the masked token skipped (not counted in the exponent) and zero; the baseline then acts on the reward-to-go,
    while the reported reverse KL stays the per-token mean."""
    first = sample([1, 0, 1, 1], [-1.0, -9.0, -0.5, -2.0], [-0.5, -1.0, -1.5, -1.0], advantage=0.0)
    second = sample([1, 1], [-2.0, -1.0], [-1.0, -1.0], advantage=0.0)
    # d: first [0.5, -, -1.0, 1.0], second [1.0, 0.0]; g = 0.5 from the end:
    # first: 1.0; -1.0 + 0.5 * 1.0 = -0.5; 0.5 + 0.5 * -0.5 = 0.25. second: 0.0; 1.0 + 0.0 = 1.0
    config = DistillationConfig(teacher_pool="t", discount=0.5)
    stats = apply_distillation([first, second], config)
    assert first.token_advantages == [0.25, 0.0, -0.5, 1.0]
    assert second.token_advantages == [1.0, 0.0]
    assert stats["distill_reverse_kl_mean"] == pytest.approx(-(0.5 - 1.0 + 1.0 + 1.0 + 0.0) / 5)
    whole = sample([1, 1, 1], [-1.0, -1.0, -1.0], [-0.5, -1.5, -0.75], advantage=0.0)
    apply_distillation([whole], DistillationConfig(teacher_pool="t", discount=1.0, baseline="batch_mean"))
    # d [0.5, -0.5, 0.25] -> reward-to-go [0.25, -0.25, 0.25], mean 1/12
    assert whole.token_advantages == pytest.approx([0.25 - 1 / 12, -0.25 - 1 / 12, 0.25 - 1 / 12])


def test_a_step_whose_task_rewards_are_all_equal_still_has_the_teachers_signal() -> None:
    """A group of equal task rewards has a zero group advantage, but its tokens still carry the distillation
    advantage: such a step must be trained, not skipped (it was: the student learned only on the steps whose groups
    happened to differ in reward)."""
    config = DistillationConfig(teacher_pool="t")
    scored = sample([1, 1], [-1.0, -2.0], [-0.5, -2.5], advantage=0.0)
    apply_distillation([scored], config)
    assert has_signal([scored], TrainConfig())
    matched = sample([1, 0], [-1.0, -2.0], [-1.0, -9.0], advantage=0.0)  # teacher agrees on the one loss token
    apply_distillation([matched], config)
    assert matched.token_advantages == [0.0, 0.0]
    assert not has_signal([matched], TrainConfig())


def test_a_distillation_job_refuses_a_trainable_sample_without_teacher_logprobs() -> None:
    scored = common_pb2.Sample(
        tokens=[1, 2, 3],
        response_start=1,
        loss_mask=[1, 1],
        rollout_logprobs=[-0.5, -0.5],
        teacher_logprobs=[-0.25, -1.0],
        status=common_pb2.SAMPLE_STATUS_COMPLETED,
    )
    unscored = common_pb2.Sample()
    unscored.CopyFrom(scored)
    del unscored.teacher_logprobs[:]
    kwargs = {"vocab_size": 16, "max_positions": 16, "distillation": True}
    taken = samples_from_group(common_pb2.Group(group_id="a", samples=[scored]), 0, **kwargs)
    assert taken[0].teacher_logprobs == [-0.25, -1.0]
    with pytest.raises(BadGroupError) as refused:
        samples_from_group(common_pb2.Group(group_id="b", samples=[scored, unscored]), 0, **kwargs)
    assert refused.value.reason == "missing_teacher_logprobs"
    assert samples_from_group(common_pb2.Group(group_id="c", samples=[unscored]), 0, vocab_size=16, max_positions=16)
    misaligned = common_pb2.Sample()
    misaligned.CopyFrom(scored)
    misaligned.teacher_logprobs.append(-3.0)
    with pytest.raises(BadGroupError) as bad:
        samples_from_group(common_pb2.Group(group_id="d", samples=[misaligned]), 0, **kwargs)
    assert bad.value.reason == "misaligned"


def test_a_baseline_centres_or_whitens_the_distillation_term_alone_over_the_batchs_loss_tokens() -> None:
    """d = teacher - student over the 4 loss tokens: 0.75, -1.0 (first; its masked token and the untrainable sample
    are left out), 1.0, 0.0 (second): mean 0.1875, population std sqrt(0.60546875). The reward term is added after."""

    def batch() -> tuple[TrainSample, TrainSample, TrainSample]:
        first = sample([1, 0, 1], [-1.0, -9.0, -0.5], [-0.25, -2.0, -1.5], advantage=0.5)
        second = sample([1, 1], [-2.0, -0.125], [-1.0, -0.125], advantage=-1.0)
        ignored = sample([1], [-5.0], [-0.0], advantage=0.0)
        ignored.trainable = False
        return first, second, ignored

    first, second, ignored = batch()
    config = DistillationConfig(teacher_pool="t", kl_coef=2.0, reward_weight=0.5, baseline="batch_mean", discount=0.0)
    stats = apply_distillation([first, second, ignored], config)
    # first: 2 * (0.75 - 0.1875) + 0.25 = 1.375; 2 * (-1.0 - 0.1875) + 0.25 = -2.125
    assert first.token_advantages == [1.375, 0.0, -2.125]
    # second: 2 * (1.0 - 0.1875) - 0.5 = 1.125; 2 * (0.0 - 0.1875) - 0.5 = -0.875
    assert second.token_advantages == [1.125, -0.875]
    assert ignored.token_advantages is None
    assert stats["distill_reverse_kl_mean"] == pytest.approx(-0.1875)  # the estimate before the baseline
    assert stats["distill_reverse_kl_std"] == pytest.approx(0.60546875**0.5)
    assert stats["distill_advantage_mean"] == pytest.approx((1.375 - 2.125 + 1.125 - 0.875) / 4)

    first, second, ignored = batch()
    config = DistillationConfig(teacher_pool="t", kl_coef=2.0, reward_weight=0.0, baseline="batch_whiten", discount=0.0)
    apply_distillation([first, second, ignored], config)
    std = 0.60546875**0.5 + BASELINE_EPS
    assert first.token_advantages == pytest.approx([2 * 0.5625 / std, 0.0, 2 * -1.1875 / std])
    assert second.token_advantages == pytest.approx([2 * 0.8125 / std, 2 * -0.1875 / std])
    assert DistillationConfig(teacher_pool="t").baseline == "none"
    assert DistillationConfig(teacher_pool="t").discount == 1.0
    for discount in (-0.1, 1.5):
        with pytest.raises(ValueError, match="discount"):
            DistillationConfig(teacher_pool="t", discount=discount)


def test_a_baseline_over_a_batch_without_loss_tokens_sets_zero_advantages() -> None:
    masked = sample([0, 0], [-1.0, -2.0], [-0.5, -2.5], advantage=0.0)
    stats = apply_distillation([masked], DistillationConfig(teacher_pool="t", baseline="batch_whiten"))
    assert masked.token_advantages == [0.0, 0.0]
    assert stats == {"distill_reverse_kl_mean": 0.0, "distill_reverse_kl_std": 0.0, "distill_advantage_mean": 0.0}
