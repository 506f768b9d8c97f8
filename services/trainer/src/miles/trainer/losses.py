"""Per-token loss terms and their aggregation; pure tensor functions, pinned by hand-computed unit tests.

Notation per response token: lp = current logprob (differentiable), old = PPO denominator (train or rollout
logprob), A = advantage, ref = reference logprob.

- PPO clip: r = exp(lp - old); loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (asymmetric: DAPO's
  clip-higher when clip_high > clip_low); dual clip (c > 1): for A < 0, loss = min(loss, -c A).
- KL to the reference with d = lp - ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (d clamped to +-20).
- Entropy bonus: -entropy_coef * H(token distribution).
- SFT: -lp.

Aggregation turns per-token losses l_t into one number with per-token weights w_t computed from *global*
batch counts, so sum_t w_t l_t over micro-batches equals the loss of the whole batch at once:
- token_mean:          w_t = m_t / N_tokens
- seq_mean_token_mean: w_t = m_t / (n_s * N_seqs)
- seq_mean_token_sum:  w_t = m_t / (divisor * N_seqs)
with m the loss mask, n_s the valid tokens of t's sequence, N_tokens the valid tokens of the batch and N_seqs
the sequences of the batch with at least one valid token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.common.jobspec.trainer import Aggregation, KlEstimator

KL_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class PolicyGradientTerms:
    """Per-token PPO outputs: the loss, the ratio and which tokens the clips were active on."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor
    dual_clipped: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> PolicyGradientTerms:
    """The clipped surrogate per token (see the module docstring). `clipped`: the clipped branch was taken."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped_loss, clipped_loss)
    clipped = (clipped_loss > unclipped_loss).float()
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        dual_clipped = capped.float()
    return PolicyGradientTerms(loss=loss, ratio=ratio.detach(), clipped=clipped, dual_clipped=dual_clipped)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KlEstimator) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from sampled tokens."""
    log_ratio = torch.clamp(logprobs - ref_logprobs, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}")


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token."""
    return -logprobs


def entropy_from_logprobs(block_logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of a (rows, vocab) log-softmax block."""
    return -(block_logprobs.exp() * block_logprobs).sum(-1)


def aggregation_weights(
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    seq_num_valid: torch.Tensor,
    *,
    mode: Aggregation,
    global_num_tokens: int,
    global_num_seqs: int,
    token_sum_divisor: float = 1.0,
) -> torch.Tensor:
    """w_t per token (see the module docstring). `seq_ids[t]` indexes `seq_num_valid` (valid tokens per sequence
    of this micro-batch); the global counts are over the whole batch (all micro-batches, all ranks)."""
    mask = loss_mask.float()
    if global_num_tokens == 0 or global_num_seqs == 0:
        return torch.zeros_like(mask)
    if mode == "token_mean":
        return mask / global_num_tokens
    if mode == "seq_mean_token_mean":
        per_token_count = seq_num_valid.float()[seq_ids].clamp(min=1.0)
        return mask / (per_token_count * global_num_seqs)
    if mode == "seq_mean_token_sum":
        return mask / (token_sum_divisor * global_num_seqs)
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate(
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    *,
    mode: Aggregation,
    token_sum_divisor: float = 1.0,
) -> torch.Tensor:
    """Aggregate per-token values of one whole batch (global counts taken from this batch itself)."""
    num_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    seq_num_valid = torch.zeros(num_seqs, dtype=torch.long).index_add_(0, seq_ids, (loss_mask > 0).long())
    weights = aggregation_weights(
        loss_mask,
        seq_ids,
        seq_num_valid,
        mode=mode,
        global_num_tokens=int((loss_mask > 0).sum()),
        global_num_seqs=int((seq_num_valid > 0).sum()),
        token_sum_divisor=token_sum_divisor,
    )
    return (values * weights).sum()
