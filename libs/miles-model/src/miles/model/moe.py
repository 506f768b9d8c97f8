"""Qwen3-MoE's sparse MLP block, computed as Hugging Face's `Qwen3MoeSparseMoeBlock`, with routing replay (R3).

Per token: router logits = gate(h) (no bias); probs = softmax(logits) in float32 over all experts; the router's
choice is top-k(probs) (`num_experts_per_tok`, descending); combine weights = probs gathered at the chosen ids,
divided by their sum iff `norm_topk_prob`; output = sum over the k slots of weight * expert(h), each expert a
SwiGLU MLP of width `moe_intermediate_size`.

Replay (R3, rollout routing replay): the caller may give the expert ids to use instead of the router's choice.
The combine weights are then the router's *current* probabilities gathered at the given ids (renormalised iff
norm_topk_prob), so the router still gets a gradient, as Miles/Megatron's R3 does. The router's own top-k is
computed and reported either way (a replay mismatch check compares the two). Free routing goes through the same
gather as replay, so replaying the recorded ids reproduces the free forward bit for bit.

Determinism (the batch-invariance contract of kernels.py): each token-expert pair's result must not depend on
which other tokens picked the same expert. The pairs are grouped by expert (a stable sort, so the order inside
a group is the token order); each group runs through `apply_rowwise` with that expert's weights, i.e. in fixed
32-row zero-padded blocks in deterministic mode, where a row's result depends only on that row (the property the
dense projections already rely on). Results are put back by pair, and the k weighted outputs are summed in slot
order (top-1 first), row-wise. Routing itself (gate, softmax, top-k, gather, renormalisation) is row-wise.

Not computed: the auxiliary load-balancing loss (`router_aux_loss_coef`, Hugging Face's
`load_balancing_loss_func`). It plays no part in logits or logprobs, so inference and R3 logprob parity do not
need it; a trainer that wants it must add it to its loss from the router probabilities (not exposed yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from miles.model.config import ModelConfig
from miles.model.kernels import apply_rowwise
from miles.model.layers import Linear, Mlp


class SparseMoeBlock(nn.Module):
    """Parameters `gate.weight` (num_experts, hidden) and `experts.E.{gate,up,down}_proj.weight`, as on the Hub."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, False)
        self.experts = nn.ModuleList(
            [Mlp(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)]
        )

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-wise: the router's probabilities (rows, num_experts) and its top-k expert ids (rows, k)."""
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float32)
        return probs, probs.topk(self.top_k, dim=-1).indices

    def combine_weights(self, probs: torch.Tensor, expert_ids: torch.Tensor) -> tuple[torch.Tensor]:
        """Row-wise: the weight of each of the k experts a row uses (differentiable in probs)."""
        weights = probs.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights,)

    def add_output(
        self, x: torch.Tensor, h: torch.Tensor, probs: torch.Tensor, expert_ids: torch.Tensor, *, deterministic: bool
    ) -> torch.Tensor:
        """x + the block's output for the normed input h, using experts `expert_ids` (rows, k) int64."""
        (weights,) = apply_rowwise(self.combine_weights, (probs, expert_ids), deterministic=deterministic)
        outputs = self._expert_outputs(h, expert_ids, deterministic)
        (x,) = apply_rowwise(_add_weighted, (x, outputs, weights), deterministic=deterministic)
        return x

    def _expert_outputs(self, h: torch.Tensor, expert_ids: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """expert_ids[t, j]'s MLP applied to h[t], for every pair: (rows, k, hidden)."""
        num_rows, top_k = expert_ids.shape
        if num_rows == 0:
            return h.new_zeros((0, top_k, h.shape[1]))
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_pair = order // top_k
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        pieces = []
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count == 0:
                continue
            assert isinstance(expert, Mlp)
            rows = h.index_select(0, token_of_pair[start : start + count])
            pieces.append(apply_rowwise(expert.rows, (rows,), deterministic=deterministic)[0])
            start += count
        by_expert = torch.cat(pieces)
        return by_expert[torch.argsort(order)].reshape(num_rows, top_k, h.shape[1])


def _add_weighted(x: torch.Tensor, outputs: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor]:
    """Row-wise: x + sum_j weights[:, j] * outputs[:, j], summed in slot order."""
    total = outputs[:, 0] * weights[:, 0, None]
    for slot in range(1, outputs.shape[1]):
        total = total + outputs[:, slot] * weights[:, slot, None]
    return (x + total,)


def check_routed_experts(routed_experts: torch.Tensor, num_rows: int, config: ModelConfig) -> torch.Tensor:
    """Validate a replay array (num_rows, num_moe_layers, top_k) of expert ids; returns it as int64.

    Raises ValueError for a dense model, a wrong shape or dtype, ids outside [0, num_experts) (including the -1
    padding some producers use) and an expert repeated within a row."""
    if config.num_moe_layers == 0:
        raise ValueError("routed_experts was given but the model has no MoE layers")
    expected = (num_rows, config.num_moe_layers, config.num_experts_per_tok)
    if not isinstance(routed_experts, torch.Tensor) or routed_experts.is_floating_point():
        raise ValueError("routed_experts must be an integer tensor")
    if routed_experts.dtype == torch.bool or routed_experts.is_complex():
        raise ValueError(f"routed_experts must be an integer tensor, got {routed_experts.dtype}")
    if tuple(routed_experts.shape) != expected:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts.shape)}, expected {expected} "
            "(tokens, MoE layers, experts per token)"
        )
    ids = routed_experts.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.num_experts):
        raise ValueError(
            f"routed_experts holds ids in [{int(ids.min())}, {int(ids.max())}], expected [0, {config.num_experts})"
        )
    ordered = ids.sort(dim=-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError("routed_experts repeats an expert within a token's top-k")
    return ids
