"""Every loss term, estimator and aggregation mode pinned against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from miles.trainer.advantages import SampleReward, compute_advantages
from miles.trainer.losses import (
    aggregate,
    aggregation_weights,
    entropy_from_logprobs,
    kl_penalty,
    ppo_clip_loss,
    sft_loss,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_ppo_clip_takes_the_pessimistic_branch_with_asymmetric_bounds() -> None:
    # ratios 0.5, 1.0, 1.5, 1.5 ; advantages 1, 1, 1, -1 ; clip [1 - 0.2, 1 + 0.28]
    logprobs = torch.log(t(0.5, 1.0, 1.5, 1.5))
    terms = ppo_clip_loss(logprobs, torch.zeros(4, dtype=torch.float64), t(1, 1, 1, -1), clip_low=0.2, clip_high=0.28)
    # A>0, r=0.5: max(-0.5, -0.8) = -0.5 (unclipped); r=1: -1; r=1.5: max(-1.5, -1.28) = -1.28 (clipped)
    # A<0, r=1.5: max(1.5, 1.28) = 1.5 (unclipped: the pessimistic branch)
    assert torch.allclose(terms.loss, t(-0.5, -1.0, -1.28, 1.5))
    assert terms.clipped.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert terms.dual_clipped.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_ppo_clip_clips_low_ratio_for_negative_advantage() -> None:
    terms = ppo_clip_loss(torch.log(t(0.5)), t(0.0), t(-2.0), clip_low=0.2, clip_high=0.2)
    # max(-(-2)*0.5, -(-2)*0.8) = max(1.0, 1.6) = 1.6
    assert torch.allclose(terms.loss, t(1.6))
    assert terms.clipped.tolist() == [1.0]


def test_dual_clip_caps_negative_advantage_loss_at_c_times_minus_a() -> None:
    logprobs = torch.log(t(5.0, 5.0, 1.1))
    terms = ppo_clip_loss(
        logprobs, torch.zeros(3, dtype=torch.float64), t(-1, 1, -1), clip_low=0.2, clip_high=0.2, dual_clip_c=3.0
    )
    # A=-1, r=5: max(5, 1.2) = 5 -> capped at 3 ; A=+1, r=5: max(-5, -1.2) = -1.2 (no dual clip for A>0);
    # A=-1, r=1.1: 1.1 < 3 -> unchanged
    assert torch.allclose(terms.loss, t(3.0, -1.2, 1.1))
    assert terms.dual_clipped.tolist() == [1.0, 0.0, 0.0]


def test_ppo_gradient_is_zero_on_clipped_tokens_and_minus_a_r_elsewhere() -> None:
    logprobs = torch.log(t(1.5, 1.1)).requires_grad_(True)
    terms = ppo_clip_loss(logprobs, torch.zeros(2, dtype=torch.float64), t(1.0, 1.0), clip_low=0.2, clip_high=0.2)
    terms.loss.sum().backward()
    assert logprobs.grad is not None
    # d(-A r)/d lp = -A r = -1.1 on the unclipped token; the clipped token gets no gradient.
    assert torch.allclose(logprobs.grad, t(0.0, -1.1))


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [math.log(2.0), -math.log(2.0)]),
        ("k2", [0.5 * math.log(2.0) ** 2, 0.5 * math.log(2.0) ** 2]),
        # k3 = exp(-d) - 1 + d: d = ln2 -> 0.5 - 1 + ln2 ; d = -ln2 -> 2 - 1 - ln2
        ("k3", [0.5 - 1 + math.log(2.0), 1 - math.log(2.0)]),
    ],
)
def test_kl_estimators(estimator: str, expected: list[float]) -> None:
    logprobs = torch.log(t(0.4, 0.1))
    reference = torch.log(t(0.2, 0.2))
    assert torch.allclose(kl_penalty(logprobs, reference, estimator), t(*expected))  # type: ignore[arg-type]


def test_kl_log_ratio_is_clamped_so_k3_stays_finite() -> None:
    value = kl_penalty(t(0.0), t(-1000.0), "k3")
    assert torch.isfinite(value).all()
    assert torch.allclose(value, t(math.exp(-20.0) - 1 + 20.0))


def test_sft_loss_and_entropy() -> None:
    assert torch.allclose(sft_loss(t(-0.5, -2.0)), t(0.5, 2.0))
    block = torch.log(t(0.5, 0.25, 0.25)).reshape(1, 3)
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert torch.allclose(entropy_from_logprobs(block), t(expected))


# Two sequences: seq 0 has tokens [1, 2, 3] (mask 1, 1, 0), seq 1 has [4, 5, 6, 7] (mask 1, 1, 1, 1).
VALUES = t(1, 2, 3, 4, 5, 6, 7)
MASK = t(1, 1, 0, 1, 1, 1, 1)
SEQ_IDS = torch.tensor([0, 0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize(
    ("mode", "divisor", "expected"),
    [
        ("token_mean", 1.0, (1 + 2 + 4 + 5 + 6 + 7) / 6),
        ("seq_mean_token_mean", 1.0, ((1 + 2) / 2 + (4 + 5 + 6 + 7) / 4) / 2),
        ("seq_mean_token_sum", 1.0, ((1 + 2) + (4 + 5 + 6 + 7)) / 2),
        ("seq_mean_token_sum", 10.0, ((1 + 2) / 10 + (4 + 5 + 6 + 7) / 10) / 2),
    ],
)
def test_aggregation_modes_with_masking(mode: str, divisor: float, expected: float) -> None:
    value = aggregate(VALUES, MASK, SEQ_IDS, mode=mode, token_sum_divisor=divisor)  # type: ignore[arg-type]
    assert value.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_over_micro_batches_equals_the_whole_batch(mode: str) -> None:
    whole = aggregate(VALUES, MASK, SEQ_IDS, mode=mode)  # type: ignore[arg-type]
    parts = []
    for seq, rows in ((0, slice(0, 3)), (1, slice(3, 7))):
        counts = torch.tensor([int(MASK[rows].sum())])
        weights = aggregation_weights(
            MASK[rows],
            torch.zeros(rows.stop - rows.start, dtype=torch.long),
            counts,
            mode=mode,
            global_num_tokens=6,
            global_num_seqs=2,  # type: ignore[arg-type]
        )
        parts.append((VALUES[rows] * weights).sum())
        assert seq in (0, 1)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


def test_sequences_without_valid_tokens_do_not_count_in_the_sequence_mean() -> None:
    value = aggregate(t(1, 2, 9), t(1, 1, 0), torch.tensor([0, 0, 1]), mode="seq_mean_token_mean")
    assert value.item() == pytest.approx(1.5)


def _rewards(*per_group: list[float], tokens: int = 2) -> list[SampleReward]:
    return [SampleReward(g, r, True, tokens) for g, rewards in enumerate(per_group) for r in rewards]


def test_grpo_normalises_by_group_mean_and_unbiased_std() -> None:
    advantages = compute_advantages(_rewards([1.0, 0.0, 0.0, 1.0], [2.0, 2.0]), "grpo", eps=1e-6)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 0.0, 0.0]
    assert advantages == pytest.approx(expected)


def test_dr_grpo_only_subtracts_the_group_mean() -> None:
    assert compute_advantages(_rewards([3.0, 1.0], [5.0]), "dr_grpo") == pytest.approx([1.0, -1.0, 0.0])


def test_reinforce_pp_baseline_whitens_over_tokens_of_the_batch() -> None:
    samples = [
        SampleReward(0, 1.0, True, 1),
        SampleReward(0, 0.0, True, 3),
        SampleReward(1, 4.0, True, 2),
        SampleReward(1, 2.0, True, 2),
    ]
    centered = [0.5, -0.5, 1.0, -1.0]
    weights = [1, 3, 2, 2]
    mean = sum(a * w for a, w in zip(centered, weights, strict=True)) / 8  # (0.5 - 1.5 + 2 - 2) / 8 = -0.125
    std = math.sqrt(sum(w * (a - mean) ** 2 for a, w in zip(centered, weights, strict=True)) / 8)
    expected = [(a - mean) / (std + 1e-6) for a in centered]
    assert compute_advantages(samples, "reinforce_pp_baseline", eps=1e-6) == pytest.approx(expected)


def test_untrainable_samples_get_zero_advantage_and_stay_out_of_group_stats() -> None:
    samples = [SampleReward(0, 1.0, True, 2), SampleReward(0, 100.0, False, 0), SampleReward(0, 0.0, True, 2)]
    assert compute_advantages(samples, "dr_grpo") == pytest.approx([0.5, 0.0, -0.5])


def test_group_of_one_gets_zero_advantage() -> None:
    assert compute_advantages(_rewards([7.0]), "grpo") == [0.0]
