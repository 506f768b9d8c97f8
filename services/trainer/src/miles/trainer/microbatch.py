"""One micro-batch's share of an optimizer step's loss, and the decoupled-PPO policy-gradient term.

Per response token: lp = log pi_theta (the forward's output, differentiable), `proximal` = log pi_old (the
trainer's logprobs under the weights before the trainer step's first update, detached), `rollout` = log mu (the
engine's, the behaviour policy), A the advantage, m the loss mask.

    old_logprobs = train   (decoupled PPO): ratio = exp(lp - proximal), clipped; w = correction(proximal, rollout)
    old_logprobs = rollout:                 ratio = exp(lp - rollout), clipped; w = 1 (correction must be none)

so the behaviour policy's mismatch is corrected exactly once: by the ratio itself (`rollout`) or by the TIS/MIS
weight (`train`). `TrainConfig.recipe_problems` refuses `rollout` with tis/mis, and `policy_gradient_loss` does
too. Loss per token: w * keep * ppo(ratio, A) + kl_coef * kl(lp, ref) - entropy_coef * H, aggregated with the
minibatch's global weights (`losses.aggregation_weights`). With a critic (`gae`), A is the token's GAE advantage
and value_loss_coef * the clipped value loss is added per token (critic.py).

Where pi_old comes from is the caller's choice (`step.py`): with a single optimizer step in the trainer step it
is the forward's own output, detached (no extra pass); with more it is a no-grad scoring pass before the first
update, held fixed for every epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.backends.base import TokenOutputs
from miles.trainer.backends.common import is_routed
from miles.trainer.batch import TrainSample
from miles.trainer.corrections import compute_correction
from miles.trainer.critic import CriticTargets, add_value_loss
from miles.trainer.losses import aggregation_weights, kl_penalty, ppo_clip_loss, sft_loss
from miles.trainer.stats import StepStats


@dataclass(frozen=True)
class Flat:
    """Per response token of a micro-batch (every response token, in sample order)."""

    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor
    seq_num_valid: torch.Tensor
    current_version: torch.Tensor


def flatten(samples: Sequence[TrainSample], trainer_version: int) -> Flat:
    masks, rollout, advantages, seq_ids, current = [], [], [], [], []
    for index, sample in enumerate(samples):
        n = len(sample.loss_mask)
        mask = sample.loss_mask if sample.trainable else [0] * n
        masks.append(torch.tensor(mask, dtype=torch.float32))
        rollout.append(torch.tensor(sample.rollout_logprobs, dtype=torch.float32))
        if sample.token_advantages is not None:
            advantages.append(torch.tensor(sample.token_advantages, dtype=torch.float32))
        else:
            advantages.append(torch.full((n,), sample.advantage, dtype=torch.float32))
        seq_ids.append(torch.full((n,), index, dtype=torch.long))
        is_current = sample.min_version == trainer_version and sample.max_version == trainer_version
        current.append(torch.full((n,), float(is_current)))
    mask_all = torch.cat(masks)
    seq_all = torch.cat(seq_ids)
    seq_num_valid = torch.zeros(len(samples), dtype=torch.long).index_add_(0, seq_all, (mask_all > 0).long())
    return Flat(mask_all, torch.cat(rollout), torch.cat(advantages), seq_all, seq_num_valid, torch.cat(current))


@dataclass(frozen=True)
class MicroBatchContext:
    """What a micro-batch's loss needs beyond its samples: the counts of its minibatch (the loss is divided by
    them), the trainer version (which data is current) and, when scored before the first update, pi_old."""

    global_num_tokens: int
    global_num_seqs: int
    trainer_version: int
    proximal_logprobs: torch.Tensor | None = None
    reference_logprobs: torch.Tensor | None = None
    critic: CriticTargets | None = None
    """PPO with a critic: the micro-batch's GAE advantages (used in place of the samples' own), value targets and
    values before the first update, computed by the step's scoring pass (critic.py)."""


@dataclass(frozen=True)
class PolicyGradient:
    """Per token: the weighted PPO loss (differentiable), the PPO ratio, the IS weight and keep mask, and which
    tokens the clips were active on (all but `loss` detached)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def policy_gradient_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    config: TrainConfig,
    stats: StepStats,
) -> PolicyGradient:
    """w * keep * ppo(ratio, A) per token, the mismatch corrected exactly once (module docstring)."""
    problems = config.recipe_problems()
    if problems:
        raise ValueError("; ".join(f"{field}: {why}" for field, why in problems))
    loss_config = config.loss
    proximal = proximal_logprobs.detach()
    denominator = proximal if loss_config.old_logprobs == "train" else rollout_logprobs
    terms = ppo_clip_loss(
        logprobs,
        denominator,
        advantages,
        clip_low=loss_config.clip_low,
        clip_high=loss_config.clip_high,
        dual_clip_c=loss_config.dual_clip_c,
    )
    num_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    correction = compute_correction(proximal, rollout_logprobs, loss_mask, seq_ids, num_seqs, config.correction, stats)
    return PolicyGradient(
        loss=terms.loss * correction.weights * correction.keep,
        ratio=terms.ratio,
        weights=correction.weights,
        keep=correction.keep,
        clipped=terms.clipped,
        dual_clipped=terms.dual_clipped,
    )


def micro_batch_loss(
    outputs: TokenOutputs,
    samples: Sequence[TrainSample],
    context: MicroBatchContext,
    config: TrainConfig,
    stats: StepStats,
) -> torch.Tensor:
    """The micro-batch's share of its minibatch's loss (already divided by the minibatch's counts) from the
    forward's `outputs`. With a KL term the reference logprobs come in `context` (computed beforehand by the
    caller: under pipeline parallelism this runs on the last stage only, inside the schedule, where no other
    forward can be started)."""
    loss_config = config.loss
    flat = flatten(samples, context.trainer_version)
    logprobs = outputs.logprobs
    proximal = context.proximal_logprobs if context.proximal_logprobs is not None else logprobs.detach()
    mask = flat.loss_mask
    weights = aggregation_weights(
        mask,
        flat.seq_ids,
        flat.seq_num_valid,
        mode=loss_config.aggregation,
        global_num_tokens=context.global_num_tokens,
        global_num_seqs=context.global_num_seqs,
        token_sum_divisor=loss_config.token_sum_divisor,
    )
    add_mismatch_stats(proximal, flat, stats)
    add_routing_stats(outputs.routing_agreement, samples, stats)
    stats.add_masked("entropy", outputs.entropy, mask)
    stats.add_mean("num_loss_tokens", float(mask.sum()), 1)
    if loss_config.kind == "sft":
        per_token = sft_loss(logprobs)
        stats.add_total("sft_loss", float((per_token.detach() * weights).sum()))
    else:
        advantages = flat.advantages if context.critic is None else context.critic.advantages
        pg = policy_gradient_loss(
            logprobs, proximal, flat.rollout_logprobs, advantages, mask, flat.seq_ids, config, stats
        )
        stats.add_total("pg_loss", float((pg.loss.detach() * weights).sum()))
        stats.add_masked("pg_clipfrac", pg.clipped, mask)
        stats.add_masked("pg_dual_clipfrac", pg.dual_clipped, mask)
        stats.add_masked("ppo_ratio", pg.ratio, mask, extremes=True)
        per_token = pg.loss
        if context.critic is not None and config.critic is not None:
            per_token = per_token + add_value_loss(outputs.values, context.critic, config.critic, weights, mask, stats)
        if loss_config.kl_coef > 0:
            if context.reference_logprobs is None:
                raise ValueError("kl_coef > 0 needs the micro-batch's reference logprobs in its context")
            kl = kl_penalty(logprobs, context.reference_logprobs, loss_config.kl_estimator)
            stats.add_total("kl", float((kl.detach() * weights).sum()))
            per_token = per_token + loss_config.kl_coef * kl
        if loss_config.entropy_coef > 0:
            per_token = per_token - loss_config.entropy_coef * outputs.entropy
    loss = (per_token * weights).sum()
    stats.add_total("loss", float(loss.detach()))
    return loss


def add_routing_stats(agreement: torch.Tensor | None, samples: Sequence[TrainSample], stats: StepStats) -> None:
    """MoE routing agreement (R3): per MoE layer (`routing_agreement_layer_<i>`) and over all layers
    (`routing_agreement`), the fraction of routed positions whose trainer top-k set equals the recorded one;
    exact means over the micro-batches, each weighted by its routed positions (rows 0..T-2 of every sample
    carrying routing)."""
    if agreement is None:
        return
    num_positions = sum(s.num_tokens - 1 for s in samples if is_routed(s))
    if num_positions == 0:
        return
    fractions = agreement.detach().double().tolist()
    for layer, fraction in enumerate(fractions):
        stats.add_mean(f"routing_agreement_layer_{layer}", fraction * num_positions, num_positions)
    stats.add_mean("routing_agreement", sum(fractions) * num_positions, len(fractions) * num_positions)


def add_mismatch_stats(proximal: torch.Tensor, flat: Flat, stats: StepStats) -> None:
    """|pi_old - mu| over loss tokens, and over tokens of data generated by the current version (strict mode)."""
    abs_diff = (proximal - flat.rollout_logprobs).abs()
    stats.add_masked("train_rollout_logprob_abs_diff", abs_diff, flat.loss_mask, extremes=True)
    stats.add_masked("current_version_logprob_abs_diff", abs_diff, flat.loss_mask * flat.current_version, extremes=True)
