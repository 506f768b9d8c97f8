"""On-policy distillation: the student samples as usual, a teacher scores the student's own tokens.

The teacher is one of the job's inference pools (`JobSpec.inference_pools`, named by `teacher_pool`): after an
episode, the rollout worker asks it for the log-probability of every response token given everything before it
(SGLang's /generate with `max_new_tokens` 0, `return_logprob` and `logprob_start_len`: `input_token_logprobs`),
and the sample carries them (`Sample.teacher_logprobs`). The trainer's per-token advantage is then

    A_t = kl_coef * sum_{k >= t} discount^(k - t) * (log p_teacher(y_k | y_<k) - log p_student(y_k | y_<k))
          + reward_weight * A_reward

(the sum over the response's loss tokens) with the student's logprob taken as the one it sampled with
(`rollout_logprobs`): the negative of the reverse-KL estimate (k1) from token t on, so maximising it pulls the
student to the teacher on the states it visits itself; A_reward is the job's advantage estimator on the task
reward (0 with `reward_weight` 0, pure distillation). Student and teacher must share a tokenizer (the teacher
scores the student's token ids as they are).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DistillationBaseline = Literal["none", "batch_mean", "batch_whiten"]


class DistillationConfig(BaseModel):
    """`train.distillation`: on-policy distillation from a teacher pool."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    teacher_pool: str = Field(min_length=1)
    """Name of the job's inference pool that serves the teacher (`inference_pools[].name`)."""

    kl_coef: float = Field(default=1.0, gt=0)
    """Weight of the per-token distillation advantage (teacher logprob - student logprob)."""

    reward_weight: float = Field(default=0.0, ge=0)
    """Weight of the task reward's advantage added to every token (0: pure distillation; then dynamic sampling does
    not discard groups of equal rewards: the teacher's signal is per token)."""

    baseline: DistillationBaseline = "none"
    """Baseline of the distillation term d = teacher logprob - student logprob, over the loss tokens of the step's
    whole batch (the task-reward term is left alone): `none` (d as it is), `batch_mean` (d minus its batch mean)
    or `batch_whiten` ((d - mean) / std). Default `none`: in the trainer's distillation learning test `batch_mean`
    lowered the KL slightly more than `none` (last-three / first-two 0.65 vs 0.67 at 32 groups, one seed), too little
    to change the default; `batch_whiten` equals `batch_mean` whenever the gradient norm exceeds grad_clip_norm."""

    discount: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount g of the distillation term's reward-to-go: token t's term is the sum over the sample's loss tokens
    k >= t of g^(k - t) * d_k (k counted in loss tokens), before the baseline. 1 (default): the whole remaining
    sequence's reverse KL, the exact gradient of the sequence-level KL, which also charges a token for the states
    it leads to. 0: each token's own d_t (per-token on-policy distillation). Measured (tests/test_e2e_distillation.py,
    a calculator agent job, 32 groups per step): with 1 the student's KL fell to ~0.55 of its start within a step
    and stayed; with 0 it rose to 1.9x as lowering each position's KL drove the answers longer, and was back to
    ~0.9x after 16 steps. On the trainer's toy task (every answer 8 tokens) both fall: to 0.18 (0) and 0.23 (1) in
    20 steps."""
