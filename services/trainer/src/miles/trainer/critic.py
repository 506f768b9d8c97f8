"""PPO with a learned critic: GAE advantages, value targets and the clipped value loss (`train.critic`).

Per sample, over its *model tokens* only (the loss-masked response tokens t_0 < ... < t_{L-1}), with V_j the value
head's prediction at token t_j's prefix (the trainer's values before the step's first update, detached) and the
sample's reward R placed on its last model token:

    r_j = R if j == L - 1 else 0,   V_L = 0 (the episode ends after its last model token)
    delta_j = r_j + gamma * V_{j+1} - V_j
    A_j = delta_j + gamma * lam * A_{j+1}        (A_L = 0)
    R_j = A_j + V_j                              (the value target, the lambda-return)

Tokens outside the loss mask (a tool's output or a user turn between two model turns, or the prompt) get no
advantage, no target and no value loss: GAE steps from one model token straight to the next, so the tokens the
environment inserted are part of that transition and gamma discounts once per model token, not per observed
token. Samples that are not trained on (ABORTED, FAILED) have no model tokens. A TRUNCATED sample is treated as
terminal, like a COMPLETED one (no bootstrap from a value past its end).

With `whiten_advantages` the advantages are then whitened over every loss token of the trainer step's batch
(every minibatch, every rank), per role: A <- (A - mean) / (std + eps), population std. The value targets come
from the raw advantages.

Value loss per model token, V the value head's current prediction and V_old the one before the step's first update:

    clipped: l = max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) / 2     (c = value_clip)
    plain:   l = (V - R)^2 / 2                                                (value_clip None)

added to the policy-gradient loss as value_loss_coef * l, aggregated like it. `value_clipfrac` counts the tokens
where the clipped branch is the larger one. With one optimizer step per trainer step V = V_old and it never binds.

Limits: the reward is the sample's scalar one (`Sample.token_rewards` are not used); GAE of a sample runs on one
rank over its own values, so a sample is never split; the whitening statistics are merged over ranks (one
all-gather of a few sums).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from miles.common.jobspec.critic import CriticConfig
from miles.trainer.batch import TrainSample
from miles.trainer.stats import StepStats

KeyT = TypeVar("KeyT")


def gae(
    values: torch.Tensor, loss_mask: torch.Tensor, reward: float, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) of one sample, per response token (0 outside the loss mask): the module docstring's
    recursion over its model tokens. Float64 inside, returned in `values`' dtype."""
    model_tokens = (loss_mask > 0).nonzero().flatten()
    model_values = values.detach().double()[model_tokens].tolist()
    advantages = [0.0] * len(model_values)
    running = 0.0
    for j in reversed(range(len(model_values))):
        next_value = model_values[j + 1] if j + 1 < len(model_values) else 0.0
        step_reward = reward if j == len(model_values) - 1 else 0.0
        running = step_reward + gamma * next_value - model_values[j] + gamma * lam * running
        advantages[j] = running
    out_advantages = torch.zeros(values.shape, dtype=torch.float64)
    out_returns = torch.zeros(values.shape, dtype=torch.float64)
    model_advantages = torch.tensor(advantages, dtype=torch.float64)
    out_advantages[model_tokens] = model_advantages
    out_returns[model_tokens] = model_advantages + torch.tensor(model_values, dtype=torch.float64)
    return out_advantages.to(values.dtype), out_returns.to(values.dtype)


@dataclass(frozen=True)
class ValueLossTerms:
    """Per-token value loss (differentiable) and where the clipped branch was taken (detached)."""

    loss: torch.Tensor
    clipped: torch.Tensor


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None
) -> ValueLossTerms:
    """The module docstring's value loss per token; `clip` None: the plain squared error / 2."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return ValueLossTerms(loss=0.5 * unclipped, clipped=torch.zeros_like(unclipped).detach())
    old = old_values.detach()
    clipped_values = old + torch.clamp(values - old, -clip, clip)
    clipped_sq = (clipped_values - returns) ** 2
    return ValueLossTerms(loss=0.5 * torch.maximum(unclipped, clipped_sq), clipped=(clipped_sq > unclipped).float())


@dataclass(frozen=True)
class CriticTargets:
    """Per response token of one micro-batch (concatenated in sample order, like `TokenOutputs`): the advantages the
    policy loss uses, the value targets and the values before the step's first update."""

    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor


def micro_batch_gae(
    samples: Sequence[TrainSample], values: torch.Tensor, config: CriticConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` of every sample of a micro-batch, concatenated (samples not trained on: 0)."""
    num_tokens = sum(len(sample.loss_mask) for sample in samples)
    if num_tokens != values.shape[0]:
        raise ValueError(
            f"{values.shape[0]} values for {num_tokens} response tokens: the forward and the batch disagree"
        )
    advantages, returns = [values.new_zeros(0)], [values.new_zeros(0)]
    offset = 0
    for sample in samples:
        num = len(sample.loss_mask)
        mask = torch.tensor(sample.loss_mask if sample.trainable else [0] * num)
        adv, ret = gae(values[offset : offset + num], mask, sample.reward, gamma=config.gamma, lam=config.lam)
        advantages.append(adv)
        returns.append(ret)
        offset += num
    return torch.cat(advantages), torch.cat(returns)


def _masks(samples: Sequence[TrainSample]) -> torch.Tensor:
    """The loss mask of every response token (0 for samples not trained on), float64."""
    return torch.tensor([m if s.trainable else 0 for s in samples for m in s.loss_mask], dtype=torch.float64)


def _role_masks(samples: Sequence[TrainSample]) -> dict[str, torch.Tensor]:
    """The loss mask split by role (key `""` for samples without a role: a real role is never empty)."""
    roles = [sample.role or "" for sample in samples for _ in sample.loss_mask]
    mask = _masks(samples)
    return {role: mask * torch.tensor([float(r == role) for r in roles]) for role in dict.fromkeys(roles)}


def critic_targets(
    micro_batches: Mapping[KeyT, Sequence[TrainSample]],
    values: Mapping[KeyT, torch.Tensor],
    config: CriticConfig,
    *,
    eps: float,
    merge: Callable[[StepStats], StepStats],
) -> tuple[dict[KeyT, CriticTargets], dict[str, float]]:
    """GAE targets of every micro-batch of this rank from its scored `values`, whitened over the whole batch (every
    rank's: `merge` combines statistics over ranks, a collective every rank calls twice here), and the batch's
    critic statistics (module docstring; `value_explained_variance` = 1 - Var(R - V_old) / Var(R) over loss tokens,
    0 when the returns do not vary)."""
    raw: dict[KeyT, tuple[torch.Tensor, torch.Tensor]] = {}
    stats = StepStats()
    for key, samples in micro_batches.items():
        advantages, returns = micro_batch_gae(samples, values[key], config)
        raw[key] = advantages, returns
        mask, old = _masks(samples), values[key].detach().double()
        for role, in_role in _role_masks(samples).items():
            stats.add_masked(f"advantage/{role}", advantages.double(), in_role)
            stats.add_masked(f"advantage_sq/{role}", advantages.double() ** 2, in_role)
        for name, series in (("return", returns.double()), ("residual", returns.double() - old), ("value", old)):
            stats.add_masked(name, series, mask)
            stats.add_masked(f"{name}_sq", series**2, mask)
    merged = merge(stats).result()
    targets = {
        key: _whitened(micro_batches[key], advantages, returns, values[key], merged, config, eps)
        for key, (advantages, returns) in raw.items()
    }
    return targets, _critic_stats(targets, micro_batches, merged, merge)


def _whitened(
    samples: Sequence[TrainSample],
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    merged: Mapping[str, float],
    config: CriticConfig,
    eps: float,
) -> CriticTargets:
    old_values = values.detach()
    if not config.whiten_advantages:
        return CriticTargets(advantages, returns, old_values)
    whitened = torch.zeros_like(advantages, dtype=torch.float64)
    for role, in_role in _role_masks(samples).items():
        mean = merged[f"advantage/{role}"]
        std = _variance(merged, f"advantage/{role}", squares=f"advantage_sq/{role}") ** 0.5
        whitened = torch.where(in_role > 0, (advantages.double() - mean) / (std + eps), whitened)
    return CriticTargets(whitened.to(advantages.dtype), returns, old_values)


def _variance(merged: Mapping[str, float], name: str, *, squares: str | None = None) -> float:
    """Population variance E[x^2] - E[x]^2 from the merged means of x (`name`) and x^2 (`squares`, default
    `<name>_sq`), floored at 0 (float rounding)."""
    return max(0.0, merged.get(squares or f"{name}_sq", 0.0) - merged.get(name, 0.0) ** 2)


def _critic_stats(
    targets: Mapping[KeyT, CriticTargets],
    micro_batches: Mapping[KeyT, Sequence[TrainSample]],
    merged: Mapping[str, float],
    merge: Callable[[StepStats], StepStats],
) -> dict[str, float]:
    """value_mean, return_mean, value_explained_variance, and the used advantages' mean, std, min and max over loss
    tokens (what the policy loss multiplies; token-level, unlike the other estimators' per-sample values)."""
    used = StepStats()
    for key, target in targets.items():
        mask = _masks(micro_batches[key])
        used.add_masked("advantage_mean", target.advantages.double(), mask)
        used.add_masked("advantage_sq", target.advantages.double() ** 2, mask)
        selected = target.advantages.double()[mask > 0]
        if selected.numel():
            used.add_min("advantage_min", float(selected.min()))
            used.add_max("advantage_max", float(selected.max()))
    result = merge(used).result()
    return_variance = _variance(merged, "return")
    explained = 1.0 - _variance(merged, "residual") / return_variance if return_variance > 0 else 0.0
    return {
        "value_mean": merged.get("value", 0.0),
        "return_mean": merged.get("return", 0.0),
        "value_explained_variance": explained,
        "advantage_mean": result.get("advantage_mean", 0.0),
        "advantage_std": _variance(result, "advantage_mean", squares="advantage_sq") ** 0.5,
        "advantage_min": result.get("advantage_min", 0.0),
        "advantage_max": result.get("advantage_max", 0.0),
    }


def add_value_loss(
    values: torch.Tensor | None,
    targets: CriticTargets,
    config: CriticConfig,
    weights: torch.Tensor,
    mask: torch.Tensor,
    stats: StepStats,
) -> torch.Tensor:
    """value_loss_coef * the per-token value loss of a micro-batch (to add to the policy loss before aggregation
    with `weights`); records `value_loss` (aggregated like the loss, before the coefficient) and `value_clipfrac`."""
    if values is None:
        raise ValueError("train.critic needs the backend's values (a value head): only the torch backend has one")
    terms = clipped_value_loss(values, targets.old_values, targets.returns, clip=config.value_clip)
    stats.add_total("value_loss", float((terms.loss.detach() * weights).sum()))
    stats.add_masked("value_clipfrac", terms.clipped, mask)
    return config.value_loss_coef * terms.loss
