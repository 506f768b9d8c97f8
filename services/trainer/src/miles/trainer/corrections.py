"""Off-policy correction of the policy-gradient term: TIS and MIS weights, plus mismatch statistics.

Per response token, d = train_logp - rollout_logp (the trainer's recomputed logprob before the step vs the
engine's), clamped to +-log_ratio_clamp before exp. Weights are detached: they scale the policy-gradient loss,
they are not optimised.

- TIS: w = clamp(exp(d), tis_lower, tis_upper) (Miles defaults [0, 2]).
- MIS: the ratio at `mis_level` — token: exp(d_t); sequence: exp(sum_s d) (masked sum over the sequence,
  broadcast to its tokens); geometric: exp(mean_s d) — then `truncate` (min(ratio, upper)), `clip`
  (clamp(ratio, lower, upper)) or `mask` (weight = ratio, tokens outside [lower, upper] dropped).
  Rejection sampling (rs_enabled) drops tokens whose ratio at rs_level is outside [rs_lower, rs_upper]; the veto
  drops a whole sequence when any of its token ratios is below rs_veto_threshold.
Dropped tokens leave the loss numerator only: aggregation denominators stay the loss-mask counts (as Miles).

Statistics (means over loss-masked tokens): `is_ratio` (pre-clamp exp(d) at token level, with min/max),
`is_weight` (final weight, with min/max), `is_clamped_fraction` (TIS: weight != ratio; MIS truncate/clip: weight
changed by the bound), `is_masked_fraction` (dropped by MIS mask or rejection), `is_veto_seq_fraction`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.common.jobspec.trainer import CorrectionConfig, MisLevel
from miles.trainer.stats import StepStats


@dataclass(frozen=True)
class Correction:
    """Per-token weight (detached) and keep mask (1 = the token stays in the policy-gradient numerator)."""

    weights: torch.Tensor
    keep: torch.Tensor


def segment_sum(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=values.dtype).index_add_(0, seq_ids, values)


def level_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, level: MisLevel
) -> torch.Tensor:
    """Per-token log-ratio at the given level (masked tokens do not enter sequence sums or means)."""
    if level == "token":
        return log_ratio
    masked = log_ratio * mask
    sums = segment_sum(masked, seq_ids, num_seqs)
    if level == "sequence":
        return sums[seq_ids]
    counts = segment_sum(mask, seq_ids, num_seqs).clamp(min=1.0)
    return (sums / counts)[seq_ids]


def compute_correction(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    config: CorrectionConfig,
    stats: StepStats,
) -> Correction:
    """Weights and keep mask for one micro-batch; adds the statistics to `stats`."""
    mask = (loss_mask > 0).float()
    log_ratio = (train_logprobs.detach() - rollout_logprobs).clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    token_ratio = torch.exp(log_ratio)
    stats.add_masked("is_ratio", token_ratio, mask, extremes=True)
    keep = mask.clone()
    if config.mode == "none":
        weights = torch.ones_like(token_ratio)
        changed = torch.zeros_like(mask)
    elif config.mode == "tis":
        weights = token_ratio.clamp(config.tis_lower, config.tis_upper)
        changed = (weights != token_ratio).float()
    else:
        weights, changed, keep = _mis(log_ratio, mask, seq_ids, num_seqs, config)
    veto_seqs = 0.0
    if config.mode == "mis" and config.rs_veto_threshold is not None:
        vetoed_tokens = (token_ratio < config.rs_veto_threshold).float() * mask
        vetoed_seqs = segment_sum(vetoed_tokens, seq_ids, num_seqs) > 0
        keep = keep * (~vetoed_seqs[seq_ids]).float()
        veto_seqs = float(vetoed_seqs.sum())
    seqs_with_tokens = float((segment_sum(mask, seq_ids, num_seqs) > 0).sum())
    stats.add_mean("is_veto_seq_fraction", veto_seqs, seqs_with_tokens)
    stats.add_masked("is_weight", weights, keep, extremes=True)
    stats.add_masked("is_clamped_fraction", changed, mask)
    stats.add_masked("is_masked_fraction", 1.0 - keep, mask)
    return Correction(weights=weights.detach(), keep=keep)


def _mis(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, config: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    clamp = config.log_ratio_clamp
    lower, upper = config.resolved_mis_lower, config.mis_upper
    ratio = torch.exp(level_log_ratio(log_ratio, mask, seq_ids, num_seqs, config.mis_level).clamp(-clamp, clamp))
    keep = mask.clone()
    if config.mis_mode == "truncate":
        weights = ratio.clamp(max=upper)
    elif config.mis_mode == "clip":
        weights = ratio.clamp(lower, upper)
    else:
        weights = ratio
        keep = keep * ((ratio >= lower) & (ratio <= upper)).float()
    changed = (weights != ratio).float()
    if config.rs_enabled:
        rs_upper = config.rs_upper if config.rs_upper is not None else upper
        rs_lower = config.rs_lower if config.rs_lower is not None else lower
        rs_ratio = torch.exp(level_log_ratio(log_ratio, mask, seq_ids, num_seqs, config.rs_level).clamp(-clamp, clamp))
        keep = keep * ((rs_ratio >= rs_lower) & (rs_ratio <= rs_upper)).float()
    return weights, changed, keep
