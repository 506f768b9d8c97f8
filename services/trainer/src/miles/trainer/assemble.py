"""From validated groups to a step plan: advantages, batch statistics (per role too: roles.py), minibatches,
micro-batches per rank.

Runs on rank 0 over the whole global batch (advantage estimators need whole groups, REINFORCE++ whitening the
whole batch). Only then is the batch split into `num_minibatches` minibatches: contiguous runs of samples in
batch order (groups stay together where the sizes allow), sizes differing by at most one. The split is the same
for every epoch (no reshuffling). Each minibatch is spread over ranks and packed into micro-batches on its own
and carries its own global counts, which its optimizer step's loss is divided by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.advantages import SampleReward, compute_advantages
from miles.trainer.batch import TrainSample
from miles.trainer.distillation import apply_distillation
from miles.trainer.packing import plan_micro_batches
from miles.trainer.roles import role_stats
from miles.trainer.step import MiniBatch, StepPlan


@dataclass(frozen=True)
class AssembledBatch:
    plan: StepPlan
    stats: dict[str, float]
    num_samples: int
    num_tokens: int


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def split_evenly(samples: Sequence[TrainSample], num_parts: int) -> list[list[TrainSample]]:
    """`num_parts` contiguous runs of `samples`, the first len % num_parts of them one longer (some may be
    empty when there are fewer samples than parts)."""
    size, extra = divmod(len(samples), num_parts)
    parts, start = [], 0
    for index in range(num_parts):
        end = start + size + (1 if index < extra else 0)
        parts.append(list(samples[start:end]))
        start = end
    return parts


def plan_minibatch(samples: Sequence[TrainSample], config: TrainConfig, world_size: int) -> MiniBatch:
    """Micro-batches per rank of one minibatch, and its global loss-token and sequence counts."""
    per_rank = plan_micro_batches([s.num_tokens for s in samples], config.micro_batch_max_tokens, world_size)
    seq_valid = [s.num_loss_tokens for s in samples]
    return MiniBatch(
        micro_batches=[[[samples[i] for i in micro] for micro in rank_batches] for rank_batches in per_rank],
        global_num_tokens=sum(seq_valid),
        global_num_seqs=sum(1 for n in seq_valid if n > 0),
    )


def assemble(
    groups: Sequence[Sequence[TrainSample]],
    staleness: Sequence[int],
    config: TrainConfig,
    *,
    trainer_version: int,
    world_size: int,
) -> AssembledBatch:
    """Advantages set on the samples (in place), statistics of the batch and the step plan."""
    samples = [sample for group in groups for sample in group]
    rewards = [
        SampleReward(s.group_index, s.reward, s.trainable, sum(s.loss_mask) if s.trainable else 0, s.role)
        for s in samples
    ]
    if config.loss.kind == "policy_gradient" and config.loss.advantage_estimator != "gae":  # gae: in the step
        advantages = compute_advantages(rewards, config.loss.advantage_estimator, eps=config.loss.advantage_eps)
        for sample, advantage in zip(samples, advantages, strict=True):
            sample.advantage = advantage
    distill_stats = apply_distillation(samples, config.distillation) if config.distillation is not None else {}
    trainable = [s for s in samples if s.trainable]
    reward_mean, reward_std = _mean_std([s.reward for s in trainable])
    advantage_mean, advantage_std = _mean_std([s.advantage for s in trainable])
    parts = split_evenly(samples, config.num_minibatches)
    plan = StepPlan([plan_minibatch(part, config, world_size) for part in parts], trainer_version=trainer_version)
    stats = {
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "advantage_mean": advantage_mean,
        "advantage_std": advantage_std,
        "advantage_min": min((s.advantage for s in trainable), default=0.0),
        "advantage_max": max((s.advantage for s in trainable), default=0.0),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "num_groups": float(len(groups)),
        "num_samples": float(len(samples)),
        "num_trainable_samples": float(len(trainable)),
        "num_micro_batches": float(plan.num_micro_batches),
        "response_length_mean": _mean_std([len(s.loss_mask) for s in trainable])[0],
        **role_stats(samples),
        **distill_stats,
    }
    stats |= _loss_token_stats(trainable)
    num_tokens = sum(s.num_tokens for s in samples)
    return AssembledBatch(plan=plan, stats=stats, num_samples=len(samples), num_tokens=num_tokens)


def _loss_token_stats(trainable: Sequence[TrainSample]) -> dict[str, float]:
    """Loss tokens the batch trains on, those masked as older than the staleness bound (stale_policy mask), and the
    masked ones' share of the loss tokens the samples had before masking."""
    masked = sum(s.num_stale_masked_tokens for s in trainable)
    kept = sum(sum(s.loss_mask) for s in trainable)
    return {
        "num_loss_tokens": float(kept),
        "stale_masked_tokens": float(masked),
        "stale_masked_token_fraction": masked / max(masked + kept, 1),
    }
