"""On-policy distillation's per-token advantages (miles.common.jobspec.distillation has the recipe).

For every trainable sample, on each loss-masked response token t, with d_t = teacher_logprob_t - rollout_logprob_t:

    A_t = kl_coef * baseline(d)_t + reward_weight * A

where rollout_logprob_t is the student's logprob as it sampled the token and A the sample's task-reward advantage
(the job's estimator, computed before). `d_t` is the negative of the per-token reverse-KL estimate (k1) at a token
the student chose, so a policy-gradient step on it lowers the student's reverse KL to the teacher on its own states.
`baseline` (DistillationConfig.baseline) acts on the distillation term alone, over the loss tokens of the whole
batch (every trainable sample of the step, before any minibatch split), with m and s the mean and (population)
standard deviation of d over them:

    none:         baseline(d)_t = d_t
    batch_mean:   baseline(d)_t = d_t - m
    batch_whiten: baseline(d)_t = (d_t - m) / (s + BASELINE_EPS)

Tokens outside the loss mask get 0 (they are not trained on anyway). With `discount` g > 0, d is first replaced by its
reward-to-go over the sample's loss tokens, R_t = d_t + g * R_next(t) (next(t): the sample's next loss token; R = 0
past the last), and the baseline's m and s are those of R.

The step metrics report the estimate before any baseline: `distill_reverse_kl_mean`, the mean over the batch's loss
tokens of (student - teacher) logprob (what should fall as the student learns), `distill_reverse_kl_std` (s, of R
with a discount), and `distill_advantage_mean`, the mean of the advantages A_t themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles.common.jobspec.distillation import DistillationConfig
from miles.trainer.batch import TrainSample

BASELINE_EPS = 1e-6
"""Added to the standard deviation before dividing (`batch_whiten`)."""


def _reward_to_go(differences: list[float | None], discount: float) -> list[float | None]:
    """Each loss token's d plus `discount` times the next loss token's reward-to-go (None stays None)."""
    result: list[float | None] = [None] * len(differences)
    running = 0.0
    for index in range(len(differences) - 1, -1, -1):
        difference = differences[index]
        if difference is not None:
            running = difference + discount * running
            result[index] = running
    return result


def apply_distillation(samples: Sequence[TrainSample], config: DistillationConfig) -> dict[str, float]:
    """Set `token_advantages` on every trainable sample (in place); the batch's distillation statistics."""
    trainable = [sample for sample in samples if sample.trainable]
    differences: list[list[float | None]] = []
    for sample in trainable:
        teacher = sample.teacher_logprobs
        assert teacher is not None, "admission refuses a trainable sample without teacher logprobs"
        differences.append(
            [
                teacher_lp - student_lp if mask else None
                for mask, student_lp, teacher_lp in zip(sample.loss_mask, sample.rollout_logprobs, teacher, strict=True)
            ]
        )
    valid = [d for per_sample in differences for d in per_sample if d is not None]
    num_tokens = len(valid)
    kl_mean = -sum(valid) / num_tokens if num_tokens else 0.0
    if config.discount > 0:
        differences = [_reward_to_go(per_sample, config.discount) for per_sample in differences]
        valid = [d for per_sample in differences for d in per_sample if d is not None]
    mean = sum(valid) / num_tokens if num_tokens else 0.0
    std = math.sqrt(sum((d - mean) ** 2 for d in valid) / num_tokens) if num_tokens else 0.0
    shift, scale = 0.0, 1.0
    if config.baseline in ("batch_mean", "batch_whiten"):
        shift = mean
    if config.baseline == "batch_whiten":
        scale = 1.0 / (std + BASELINE_EPS)
    advantage_sum = 0.0
    for sample, per_sample in zip(trainable, differences, strict=True):
        reward_term = config.reward_weight * sample.advantage
        advantages = []
        for difference in per_sample:
            if difference is None:
                advantages.append(0.0)
                continue
            advantage = config.kl_coef * (difference - shift) * scale + reward_term
            advantages.append(advantage)
            advantage_sum += advantage
        sample.token_advantages = advantages
    denominator = max(1, num_tokens)
    return {
        "distill_reverse_kl_mean": kl_mean,
        "distill_reverse_kl_std": std,
        "distill_advantage_mean": advantage_sum / denominator,
    }
