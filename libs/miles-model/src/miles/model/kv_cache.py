"""Key/value storage of one sequence, and detached KV blocks that a prefix cache can hold and share.

`SequenceKV` keeps, per layer, a token-major buffer (capacity, num_kv_heads, head_dim) for keys and another for
values; positions [0, length) are filled. Per-layer tensors (not one stacked tensor) keep autograd simple for
callers that write into them and make prefix views `keys(layer, t)` identical in stride to freshly computed keys.
Buffers live on the `device` they are built for (the model's: the CPU by default, a GPU for an engine computing
there); blocks exported from them stay on that device.

`KVBlock` is a copy of positions [start, end) of a sequence for all layers — what a radix-tree node stores.
Splitting a block returns views (no copy); `SequenceKV.load_prefix` copies blocks into a new sequence's buffers.

For MoE models a sequence built by `SequenceKV.for_config` also keeps, per token, the experts it was routed to at
each MoE layer (int32, -1 where not computed yet), and its blocks carry them: the routing of a prefix-cache hit
comes back with its keys and values, so an engine reports `routed_experts` for every row of a request, as SGLang
does. The routing is part of the cached state because a cached token's keys in later layers depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from miles.model.config import ModelConfig


@dataclass(frozen=True)
class KVBlock:
    """Keys and values of consecutive tokens for every layer: tensors (num_layers, num_tokens, kv_heads, head_dim);
    for MoE models also `routed_experts` (num_tokens, num_moe_layers, top_k) int32."""

    keys: torch.Tensor
    values: torch.Tensor
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[1])

    def split_at(self, num_tokens: int) -> tuple[KVBlock, KVBlock]:
        """The first `num_tokens` tokens and the rest (views of this block)."""
        routed = self.routed_experts
        return (
            KVBlock(
                self.keys[:, :num_tokens], self.values[:, :num_tokens], None if routed is None else routed[:num_tokens]
            ),
            KVBlock(
                self.keys[:, num_tokens:], self.values[:, num_tokens:], None if routed is None else routed[num_tokens:]
            ),
        )


class SequenceKV:
    """KV buffers of one sequence with a fixed capacity in tokens (and routed experts when num_moe_layers > 0)."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        *,
        num_moe_layers: int = 0,
        top_k: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (max(capacity, 1), num_kv_heads, head_dim)
        self.capacity = max(capacity, 1)
        self._keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._routed = torch.full((self.capacity, num_moe_layers, top_k), -1, dtype=torch.int32, device=device)
        self.length = 0

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        *,
        device: torch.device | str = "cpu",
    ) -> SequenceKV:
        """Buffers shaped for a model, storing routed experts when it has MoE layers, on the model's `device`."""
        return cls(
            config.num_hidden_layers,
            capacity,
            config.num_key_value_heads,
            config.head_dim,
            dtype,
            num_moe_layers=config.num_moe_layers,
            top_k=config.num_experts_per_tok,
            device=device,
        )

    @property
    def stores_routing(self) -> bool:
        return self._routed.shape[1] > 0

    def write_routing(self, moe_layer: int, start: int, expert_ids: torch.Tensor) -> None:
        """Store the experts positions [start, start + len(expert_ids)) used at one MoE layer: (n, top_k)."""
        end = start + expert_ids.shape[0]
        if end > self.capacity:
            raise ValueError(f"KV capacity {self.capacity} exceeded (writing up to position {end})")
        self._routed[start:end, moe_layer] = expert_ids

    def routed_experts(self, start: int, end: int) -> torch.Tensor:
        """A copy of the experts positions [start, end) used: (end - start, num_moe_layers, top_k) int32.

        An engine answers `return_routed_experts` with `routed_experts(routed_experts_start_len, seqlen - 1)`."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"routing of positions [{start}, {end}) requested but only {self.length} are filled")
        return self._routed[start:end].clone()

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
            if self.stores_routing:
                if block.routed_experts is None:
                    raise ValueError("a prefix block without routed experts cannot fill a sequence that stores them")
                self._routed[position : position + n] = block.routed_experts
            position += n
        self.length = position

    def export(self, start: int, end: int) -> KVBlock:
        """A copy of positions [start, end) for every layer (independent of this sequence's buffers)."""
        if end > self.length:
            raise ValueError(f"positions up to {end} requested but only {self.length} are filled")
        return KVBlock(
            torch.stack([k[start:end] for k in self._keys]),
            torch.stack([v[start:end] for v in self._values]),
            self._routed[start:end].clone() if self.stores_routing else None,
        )
