"""Parameter holders with Hugging Face's names, shared by the decoder (transformer.py) and the MoE block (moe.py).

They own parameters, not the forward: the model calls the row-wise functions below through
`kernels.apply_rowwise`, so that the deterministic mode controls the shape of every kernel call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from miles.model.kernels import linear


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=torch.float32))


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num, dim)


class Mlp(nn.Module):
    """SwiGLU MLP: down(silu(gate(h)) * up(h)); a dense layer's MLP or one expert of a sparse layer."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, False)
        self.up_proj = Linear(hidden_size, intermediate_size, False)
        self.down_proj = Linear(intermediate_size, hidden_size, False)

    def rows(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        """Row-wise: the MLP output of each row of h."""
        return (self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)),)
