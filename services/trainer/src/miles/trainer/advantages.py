"""Advantage estimators: one scalar per sample from the rewards of its group (broadcast to its tokens later).

A "group" here is a baseline group: the samples of one buffer group *and one role*. A multi-agent episode gives
samples of several roles (`Sample.metadata["role"]`, e.g. solver and verifier, each with its own reward scale);
samples of different roles never share a mean, a std or a whitening. Samples without a role form one role of
their own (None), so a batch without roles is computed exactly as before roles existed. Several samples of one
episode (per-turn mode) are each a member of their (group, role), as they always were.

With r the rewards of a baseline group's trainable samples (COMPLETED / TRUNCATED) and n their number:
- `grpo`:     A_i = (r_i - mean(r)) / (std(r) + eps), std unbiased (n - 1); a group of one gets A = 0.
- `dr_grpo`:  A_i = r_i - mean(r)  (Dr.GRPO: no std division, which biases towards easy/hard prompts).
- `reinforce_pp_baseline`: A_i = r_i - mean(r), then whitened over every valid token of the whole batch:
  A <- (A - mean_tok(A)) / (std_tok(A) + eps), mean and (population) std weighted by each sample's number of
  loss-masked tokens (REINFORCE++ with a group-mean baseline); with roles, whitened over each role's samples of
  the batch on their own.
Samples that are not trainable get A = 0 and do not enter the statistics. A group whose trainable rewards are
all equal gets exactly A = 0 (the mean is taken as that reward, so float rounding of the sum cannot leave a
1e-17 advantage for Adam to normalise into a full-size update); a buffer group in which this holds for every
role carries no signal (`roles_have_signal`), and dynamic sampling discards it before it reaches a batch.

`gae` is not computed here: it needs the critic's values, which only the trainer step's forward gives
(`miles.trainer.critic`).

Limit: `Sample.token_rewards` are not used (the scalar reward drives every estimator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from miles.common.jobspec.trainer import AdvantageEstimator


@dataclass(frozen=True)
class SampleReward:
    """What an estimator needs of one sample."""

    group_index: int
    reward: float
    trainable: bool
    num_loss_tokens: int
    role: str | None = None
    """The sample's role in a multi-agent episode (None: no role)."""

    @property
    def baseline_key(self) -> tuple[int, str | None]:
        """The baseline group the sample belongs to: its group and its role."""
        return self.group_index, self.role


def group_baseline_advantages(samples: Sequence[SampleReward], *, divide_by_std: bool, eps: float) -> list[float]:
    """r - (group, role) mean (optionally / (its std + eps)) for trainable samples, 0 for the others."""
    by_group: dict[tuple[int, str | None], list[float]] = {}
    for sample in samples:
        if sample.trainable:
            by_group.setdefault(sample.baseline_key, []).append(sample.reward)
    stats: dict[tuple[int, str | None], tuple[float, float]] = {}
    for key, rewards in by_group.items():
        mean = rewards[0] if len(set(rewards)) == 1 else sum(rewards) / len(rewards)
        num = len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (num - 1)) if num > 1 else 0.0
        stats[key] = (mean, std)
    advantages = []
    for sample in samples:
        if not sample.trainable:
            advantages.append(0.0)
            continue
        mean, std = stats[sample.baseline_key]
        centered = sample.reward - mean
        advantages.append(centered / (std + eps) if divide_by_std else centered)
    return advantages


def group_has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's trainable samples' rewards differ (else every group-baseline advantage is 0)."""
    return len(set(rewards)) > 1


def roles_have_signal(rewards: Sequence[tuple[str | None, float]]) -> bool:
    """Whether, for some role, the trainable samples' rewards of a group differ ((role, reward) pairs; without
    roles this is `group_has_signal`): equal rewards within every role give every advantage 0."""
    by_role: dict[str | None, list[float]] = {}
    for role, reward in rewards:
        by_role.setdefault(role, []).append(reward)
    return any(group_has_signal(role_rewards) for role_rewards in by_role.values())


def whiten_over_tokens(advantages: Sequence[float], samples: Sequence[SampleReward], *, eps: float) -> list[float]:
    """(A - mean) / (std + eps) with mean and population std over valid tokens (each sample counted per token)."""
    weights = [s.num_loss_tokens if s.trainable else 0 for s in samples]
    total = sum(weights)
    if total == 0:
        return [0.0] * len(advantages)
    mean = sum(a * w for a, w in zip(advantages, weights, strict=True)) / total
    var = sum(w * (a - mean) ** 2 for a, w in zip(advantages, weights, strict=True)) / total
    std = math.sqrt(var)
    return [((a - mean) / (std + eps)) if w else 0.0 for a, w in zip(advantages, weights, strict=True)]


def whiten_per_role(advantages: Sequence[float], samples: Sequence[SampleReward], *, eps: float) -> list[float]:
    """`whiten_over_tokens` over each role's samples on their own (samples without a role: one more role); a
    batch of one role is whitened exactly as `whiten_over_tokens` whitens it (same values, same order)."""
    by_role: dict[str | None, list[int]] = {}
    for index, sample in enumerate(samples):
        by_role.setdefault(sample.role, []).append(index)
    whitened = [0.0] * len(advantages)
    for indices in by_role.values():
        part = whiten_over_tokens([advantages[i] for i in indices], [samples[i] for i in indices], eps=eps)
        for index, value in zip(indices, part, strict=True):
            whitened[index] = value
    return whitened


def compute_advantages(
    samples: Sequence[SampleReward], estimator: AdvantageEstimator, *, eps: float = 1e-6
) -> list[float]:
    """One advantage per sample, in order."""
    if estimator == "grpo":
        return group_baseline_advantages(samples, divide_by_std=True, eps=eps)
    if estimator == "dr_grpo":
        return group_baseline_advantages(samples, divide_by_std=False, eps=eps)
    if estimator == "reinforce_pp_baseline":
        centered = group_baseline_advantages(samples, divide_by_std=False, eps=eps)
        return whiten_per_role(centered, samples, eps=eps)
    if estimator == "gae":
        raise ValueError("gae advantages come from the critic's values, in the trainer step (miles.trainer.critic)")
    raise ValueError(f"unknown advantage estimator {estimator!r}")
