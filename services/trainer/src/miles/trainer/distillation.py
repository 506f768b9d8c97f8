"""On-policy distillation's per-token advantages (miles.common.jobspec.distillation has the recipe).

For every trainable sample, on each loss-masked response token t:

    A_t = kl_coef * (teacher_logprob_t - rollout_logprob_t) + reward_weight * A

where rollout_logprob_t is the student's logprob as it sampled the token and A the sample's task-reward advantage
(the job's estimator, computed before). Tokens outside the loss mask get 0 (they are not trained on anyway).
`teacher_logprob - student_logprob` is the negative of the per-token reverse-KL estimate (k1) at a token the
student chose, so a policy-gradient step on it lowers the student's reverse KL to the teacher on its own states.

The step metrics report that estimate: `distill_reverse_kl_mean`, the mean over the batch's loss tokens of
(student - teacher) logprob (what should fall as the student learns), and `distill_advantage_mean`.
"""

from __future__ import annotations

from collections.abc import Sequence

from miles.common.jobspec.distillation import DistillationConfig
from miles.trainer.batch import TrainSample


def apply_distillation(samples: Sequence[TrainSample], config: DistillationConfig) -> dict[str, float]:
    """Set `token_advantages` on every trainable sample (in place); the batch's distillation statistics."""
    kl_sum, advantage_sum, num_tokens = 0.0, 0.0, 0
    for sample in samples:
        if not sample.trainable:
            continue
        teacher = sample.teacher_logprobs
        assert teacher is not None, "admission refuses a trainable sample without teacher logprobs"
        reward_term = config.reward_weight * sample.advantage
        advantages = []
        for mask, student_lp, teacher_lp in zip(sample.loss_mask, sample.rollout_logprobs, teacher, strict=True):
            if not mask:
                advantages.append(0.0)
                continue
            advantage = config.kl_coef * (teacher_lp - student_lp) + reward_term
            advantages.append(advantage)
            kl_sum += student_lp - teacher_lp
            advantage_sum += advantage
            num_tokens += 1
        sample.token_advantages = advantages
    denominator = max(1, num_tokens)
    return {"distill_reverse_kl_mean": kl_sum / denominator, "distill_advantage_mean": advantage_sum / denominator}
