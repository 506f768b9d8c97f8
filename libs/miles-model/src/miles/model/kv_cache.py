"""Key/value storage of one sequence, and detached KV blocks that a prefix cache can hold and share.

`SequenceKV` keeps, per layer, a token-major buffer (capacity, num_kv_heads, head_dim) for keys and another for
values; positions [0, length) are filled. Per-layer tensors (not one stacked tensor) keep autograd simple for
callers that write into them and make prefix views `keys(layer, t)` identical in stride to freshly computed keys.

`KVBlock` is a copy of positions [start, end) of a sequence for all layers — what a radix-tree node stores.
Splitting a block returns views (no copy); `SequenceKV.load_prefix` copies blocks into a new sequence's buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVBlock:
    """Keys and values of consecutive tokens for every layer: tensors (num_layers, num_tokens, kv_heads, head_dim)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    def split_at(self, num_tokens: int) -> tuple[KVBlock, KVBlock]:
        """The first `num_tokens` tokens and the rest (views of this block)."""
        return (
            KVBlock(self.keys[:, :num_tokens], self.values[:, :num_tokens]),
            KVBlock(self.keys[:, num_tokens:], self.values[:, num_tokens:]),
        )


class SequenceKV:
    """KV buffers of one sequence with a fixed capacity in tokens."""

    def __init__(
        self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32
    ) -> None:
        shape = (max(capacity, 1), num_kv_heads, head_dim)
        self.capacity = max(capacity, 1)
        self._keys = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self._values = [torch.empty(shape, dtype=dtype) for _ in range(num_layers)]
        self.length = 0

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values of positions [start, start + len(keys)) for one layer."""
        end = start + keys.shape[0]
        if end > self.capacity:
            raise ValueError(f"KV capacity {self.capacity} exceeded (writing up to position {end})")
        self._keys[layer][start:end] = keys
        self._values[layer][start:end] = values
        if layer == len(self._keys) - 1:
            self.length = max(self.length, end)

    def keys(self, layer: int, end: int) -> torch.Tensor:
        return self._keys[layer][:end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        return self._values[layer][:end]

    def load_prefix(self, blocks: Sequence[KVBlock]) -> None:
        """Copy consecutive blocks into positions [0, sum of their lengths)."""
        position = 0
        for block in blocks:
            n = block.num_tokens
            if position + n > self.capacity:
                raise ValueError(f"KV capacity {self.capacity} exceeded by a prefix of {position + n} tokens")
            for layer, (keys, values) in enumerate(zip(self._keys, self._values, strict=True)):
                keys[position : position + n] = block.keys[layer]
                values[position : position + n] = block.values[layer]
            position += n
        self.length = position

    def export(self, start: int, end: int) -> KVBlock:
        """A copy of positions [start, end) for every layer (independent of this sequence's buffers)."""
        if end > self.length:
            raise ValueError(f"positions up to {end} requested but only {self.length} are filled")
        return KVBlock(
            torch.stack([k[start:end] for k in self._keys]),
            torch.stack([v[start:end] for v in self._values]),
        )
