"""Seeded random initialisation: the same seed and config give the same weights, bit for bit, on any machine
with the same torch version (one CPU generator, parameters drawn in name order)."""

from __future__ import annotations

import torch

from miles.model.transformer import CausalLM


@torch.no_grad()
def init_random_weights(model: CausalLM, *, seed: int, std: float = 0.02, embedding_std: float = 0.02) -> None:
    """Normal(0, std) matrices, Normal(0, embedding_std) embeddings, ones for norm weights, zeros for biases."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            scale = embedding_std if "embed_tokens" in name else std
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * scale)
