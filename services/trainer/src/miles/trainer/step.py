"""One optimizer step over a planned batch: forward/backward per micro-batch, loss terms, statistics, the
strict on-policy check, then the optimizer step. Runs on every rank with that rank's micro-batches.

Per micro-batch the trainer's recomputed logprobs are the forward's own output, detached (`train_logp`): all
micro-batches of a step see the weights of the current version, so no separate scoring pass is needed.
Loss per token (policy_gradient):  w_is * keep * ppo(lp, old, A) + kl_coef * kl(lp, ref) - entropy_coef * H,
aggregated with the global weights of `losses.aggregation_weights` (see the README for the formulas).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.backends.base import TrainBackend
from miles.trainer.batch import TrainSample
from miles.trainer.corrections import compute_correction
from miles.trainer.losses import aggregation_weights, kl_penalty, ppo_clip_loss, sft_loss
from miles.trainer.stats import StepStats

DUMMY_SAMPLE = TrainSample(
    group_id="",
    sample_id="dummy",
    group_index=0,
    tokens=[0, 0],
    response_start=1,
    loss_mask=[0],
    rollout_logprobs=[0.0],
    reward=0.0,
    trainable=False,
    min_version=None,
    max_version=None,
)


@dataclass
class StepPlan:
    """What every rank needs to run one step. `micro_batches[rank][i]` are the samples of micro-batch i of a
    rank; ranks with fewer micro-batches than `num_micro_batches` run empty ones (FSDP collectives stay in
    lockstep). Global counts are over the whole batch."""

    micro_batches: list[list[list[TrainSample]]]
    global_num_tokens: int
    global_num_seqs: int
    trainer_version: int

    @property
    def num_micro_batches(self) -> int:
        return max((len(per_rank) for per_rank in self.micro_batches), default=0)


@dataclass
class StepResult:
    """Merged statistics of every rank; `violation` is set (and no optimizer step taken) when strict
    on-policy failed."""

    stats: dict[str, float]
    grad_norm: float = 0.0
    learning_rate: float = 0.0
    violation: str | None = None
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0
    raw: StepStats = field(default_factory=StepStats)


@dataclass(frozen=True)
class _Flat:
    """Per response token of a micro-batch (every response token, in sample order)."""

    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor
    seq_num_valid: torch.Tensor
    current_version: torch.Tensor


def _flatten(samples: Sequence[TrainSample], trainer_version: int) -> _Flat:
    masks, rollout, advantages, seq_ids, current = [], [], [], [], []
    for index, sample in enumerate(samples):
        n = len(sample.loss_mask)
        mask = sample.loss_mask if sample.trainable else [0] * n
        masks.append(torch.tensor(mask, dtype=torch.float32))
        rollout.append(torch.tensor(sample.rollout_logprobs, dtype=torch.float32))
        advantages.append(torch.full((n,), sample.advantage, dtype=torch.float32))
        seq_ids.append(torch.full((n,), index, dtype=torch.long))
        is_current = sample.min_version == trainer_version and sample.max_version == trainer_version
        current.append(torch.full((n,), float(is_current)))
    mask_all = torch.cat(masks)
    seq_all = torch.cat(seq_ids)
    seq_num_valid = torch.zeros(len(samples), dtype=torch.long).index_add_(0, seq_all, (mask_all > 0).long())
    return _Flat(mask_all, torch.cat(rollout), torch.cat(advantages), seq_all, seq_num_valid, torch.cat(current))


def micro_batch_loss(
    backend: TrainBackend, samples: Sequence[TrainSample], plan: StepPlan, config: TrainConfig, stats: StepStats
) -> torch.Tensor:
    """The micro-batch's share of the global loss (already divided by global counts)."""
    loss_config = config.loss
    flat = _flatten(samples, plan.trainer_version)
    outputs = backend.forward(samples, temperature=loss_config.temperature, entropy_grad=loss_config.entropy_coef > 0)
    logprobs = outputs.logprobs
    train_logprobs = logprobs.detach()
    mask = flat.loss_mask
    weights = aggregation_weights(
        mask,
        flat.seq_ids,
        flat.seq_num_valid,
        mode=loss_config.aggregation,
        global_num_tokens=plan.global_num_tokens,
        global_num_seqs=plan.global_num_seqs,
        token_sum_divisor=loss_config.token_sum_divisor,
    )
    abs_diff = (train_logprobs - flat.rollout_logprobs).abs()
    stats.add_masked("train_rollout_logprob_abs_diff", abs_diff, mask, extremes=True)
    stats.add_masked("current_version_logprob_abs_diff", abs_diff, mask * flat.current_version, extremes=True)
    stats.add_masked("entropy", outputs.entropy, mask)
    stats.add_mean("num_loss_tokens", float(mask.sum()), 1)
    if loss_config.kind == "sft":
        per_token = sft_loss(logprobs)
        stats.add_total("sft_loss", float((per_token.detach() * weights).sum()))
    else:
        per_token = _policy_gradient(logprobs, train_logprobs, flat, weights, config, stats)
        if loss_config.kl_coef > 0:
            reference = backend.reference_logprobs(samples, temperature=loss_config.temperature)
            kl = kl_penalty(logprobs, reference, loss_config.kl_estimator)
            stats.add_total("kl", float((kl.detach() * weights).sum()))
            per_token = per_token + loss_config.kl_coef * kl
        if loss_config.entropy_coef > 0:
            per_token = per_token - loss_config.entropy_coef * outputs.entropy
    loss = (per_token * weights).sum()
    stats.add_total("loss", float(loss.detach()))
    return loss


def _policy_gradient(
    logprobs: torch.Tensor,
    train_logprobs: torch.Tensor,
    flat: _Flat,
    weights: torch.Tensor,
    config: TrainConfig,
    stats: StepStats,
) -> torch.Tensor:
    loss_config = config.loss
    old = train_logprobs if loss_config.old_logprobs == "train" else flat.rollout_logprobs
    terms = ppo_clip_loss(
        logprobs,
        old,
        flat.advantages,
        clip_low=loss_config.clip_low,
        clip_high=loss_config.clip_high,
        dual_clip_c=loss_config.dual_clip_c,
    )
    num_seqs = int(flat.seq_num_valid.shape[0])
    correction = compute_correction(
        train_logprobs, flat.rollout_logprobs, flat.loss_mask, flat.seq_ids, num_seqs, config.correction, stats
    )
    pg = terms.loss * correction.weights * correction.keep
    stats.add_total("pg_loss", float((pg.detach() * weights).sum()))
    stats.add_masked("pg_clipfrac", terms.clipped, flat.loss_mask)
    stats.add_masked("pg_dual_clipfrac", terms.dual_clipped, flat.loss_mask)
    stats.add_masked("ppo_ratio", terms.ratio, flat.loss_mask, extremes=True)
    return pg


def run_step(
    backend: TrainBackend,
    plan: StepPlan,
    config: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    merge_stats: Callable[[StepStats], StepStats] | None = None,
) -> StepResult:
    """Forward/backward of this rank's micro-batches, merge statistics over ranks, strict check, step."""
    started = time.perf_counter()
    backend.zero_grad()
    stats = StepStats()
    own = plan.micro_batches[rank] if rank < len(plan.micro_batches) else []
    for index in range(plan.num_micro_batches):
        if index < len(own):
            loss = micro_batch_loss(backend, own[index], plan, config, stats)
        else:
            loss = backend.forward([DUMMY_SAMPLE], temperature=1.0, entropy_grad=False).logprobs.sum() * 0.0
        # FSDP averages gradients over ranks; the loss is already a share of the global sum.
        torch.autograd.backward(loss * world_size)
    merged = merge_stats(stats) if merge_stats is not None else stats
    values = merged.result()
    forward_backward_s = time.perf_counter() - started
    violation = _on_policy_violation(values, config)
    if violation is not None:
        backend.zero_grad()
        return StepResult(stats=values, violation=violation, forward_backward_s=forward_backward_s, raw=merged)
    started = time.perf_counter()
    learning_rate = backend.learning_rate()
    grad_norm = backend.step(config.optimizer.grad_clip_norm)
    return StepResult(
        stats=values,
        grad_norm=grad_norm,
        learning_rate=learning_rate,
        forward_backward_s=forward_backward_s,
        optimizer_s=time.perf_counter() - started,
        raw=merged,
    )


def _on_policy_violation(values: dict[str, float], config: TrainConfig) -> str | None:
    if not config.strict_on_policy:
        return None
    worst = values.get("current_version_logprob_abs_diff_max", 0.0)
    if worst != 0.0:
        return (
            f"strict_on_policy: recomputed logprobs of current-version data differ from the rollout logprobs "
            f"(max abs diff {worst:.3g}); engine and trainer must run deterministic mode with the same weights"
        )
    return None
