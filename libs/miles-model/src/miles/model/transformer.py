"""Our torch implementation of the Llama-family decoder (Qwen3 first, Qwen3-MoE too), with Hugging Face names.

Parameter names equal the Hugging Face checkpoint's (`model.layers.0.self_attn.q_proj.weight`, ...,
`model.layers.0.mlp.experts.3.up_proj.weight`), so a safetensors directory loads by name and `state_dict()` saves
one that Hugging Face loads back.

One forward serves every caller:
- the engine: `forward_segments` over several sequences at once, each a `Segment` of new tokens appended at
  `start_pos` to a `SequenceKV` (prefill of uncached suffixes and single-token decode are the same call);
- the trainer: `forward(input_ids)` on one full sequence without a cache, differentiable.
With `deterministic=True` both give bit-identical hidden states for the same token at the same position,
whatever else is in the batch and however the sequence was split into segments (see `kernels.py`).

MoE models (moe.py): `forward_routed` also returns the experts the router picked per token and MoE layer, and
every forward takes `routed_experts` to replay given picks instead (R3). A `SequenceKV` built with
`SequenceKV.for_config` stores the experts each cached token used, so an engine can report the routing of a
whole sequence, prefix-cache hits included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from miles.model.attention import exact_attention, fast_attention
from miles.model.config import ModelConfig
from miles.model.kernels import apply_rope, apply_rowwise, rms_norm, rope_tables, single_threaded
from miles.model.kv_cache import SequenceKV
from miles.model.layers import Embedding, Linear, Mlp, Norm
from miles.model.moe import SparseMoeBlock, check_routed_experts


@dataclass
class Segment:
    """New tokens of one sequence: `input_ids` (n,) int64 at positions [start_pos, start_pos + n).

    With `kv`, positions before start_pos are read from it and the new keys/values are written into it;
    without, start_pos must be 0 (the whole sequence is in input_ids).
    """

    input_ids: torch.Tensor
    start_pos: int = 0
    kv: SequenceKV | None = None


@dataclass(frozen=True)
class ForwardOutput:
    """What `CausalLM.forward_routed` returns for the new tokens of all segments, in segment order.

    `hidden`: final-normed hidden states (rows, hidden_size).
    `routed_experts`: (rows, num_moe_layers, top_k) int32, the router's own top-k per token and MoE layer (MoE
    layers in ascending layer order, dense layers skipped; experts in descending probability), i.e. SGLang's
    `routed_experts` layout. Without replay these are the experts used; under replay the given ones were used
    and these are what the router would have picked. (rows, 0, 0) for a dense model.
    """

    hidden: torch.Tensor
    routed_experts: torch.Tensor


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, False)
        if c.qk_norm:
            self.q_norm = Norm(c.head_dim)
            self.k_norm = Norm(c.head_dim)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = Norm(config.hidden_size)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = Norm(config.hidden_size)
        self.mlp: Mlp | SparseMoeBlock
        if layer_index in config.moe_layer_indices:
            self.mlp = SparseMoeBlock(config)
        else:
            self.mlp = Mlp(config.hidden_size, config.intermediate_size)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row-wise: the rotated queries and keys and the values of each row."""
        c, attn = self.config, self.self_attn
        h = rms_norm(x, self.input_layernorm.weight, c.rms_norm_eps)
        q = attn.q_proj(h).view(-1, c.num_attention_heads, c.head_dim)
        k = attn.k_proj(h).view(-1, c.num_key_value_heads, c.head_dim)
        v = attn.v_proj(h).view(-1, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, attn.q_norm.weight, c.rms_norm_eps)
            k = rms_norm(k, attn.k_norm.weight, c.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor]:
        """Row-wise (dense layers): output projection, residual, MLP, residual."""
        x = x + self.self_attn.o_proj(attended)
        h = rms_norm(x, self.post_attention_layernorm.weight, self.config.rms_norm_eps)
        mlp = self.mlp
        assert isinstance(mlp, Mlp)
        return (x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)),)

    def route(
        self, x: torch.Tensor, attended: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row-wise (sparse layers): residual after attention, the MoE input, router probabilities and top-k."""
        x = x + self.self_attn.o_proj(attended)
        h = rms_norm(x, self.post_attention_layernorm.weight, self.config.rms_norm_eps)
        assert isinstance(self.mlp, SparseMoeBlock)
        probs, top_ids = self.mlp.route(h)
        return x, h, probs, top_ids


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([_DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Norm(config.hidden_size)


class CausalLM(nn.Module):
    """A decoder-only language model; float32 on the CPU. Weights start at zero: load them (checkpoint.py)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, False)
        cos, sin = rope_tables(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attention_scale = config.head_dim**-0.5

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The (vocab_size, hidden_size) output projection (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, *, deterministic: bool = False, routed_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states (T, hidden) of one whole sequence `input_ids` (T,); differentiable.

        `routed_experts` (T, num_moe_layers, top_k): expert ids to replay (see `forward_routed`)."""
        return self.forward_routed(
            [Segment(input_ids)], deterministic=deterministic, routed_experts=routed_experts
        ).hidden

    def forward_segments(
        self,
        segments: Sequence[Segment],
        *,
        deterministic: bool = False,
        routed_experts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of every new token of every segment, concatenated in segment order."""
        return self.forward_routed(segments, deterministic=deterministic, routed_experts=routed_experts).hidden

    def forward_routed(
        self,
        segments: Sequence[Segment],
        *,
        deterministic: bool = False,
        routed_experts: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Hidden states and the router's picks of every new token of every segment, in segment order.

        `routed_experts`: optional (rows, num_moe_layers, top_k) integer expert ids, one row per new token in
        segment order, used instead of the router's top-k (routing replay); combine weights are then the
        router's probabilities at those ids. Raises ValueError when it does not fit the model (moe.py).
        Segments whose `kv` stores routing (`SequenceKV.for_config`) get the experts used written into it."""
        if deterministic:
            with single_threaded():
                return self._forward_routed(segments, deterministic=True, routed_experts=routed_experts)
        return self._forward_routed(segments, deterministic=False, routed_experts=routed_experts)

    def _forward_routed(
        self, segments: Sequence[Segment], *, deterministic: bool, routed_experts: torch.Tensor | None
    ) -> ForwardOutput:
        for segment in segments:
            if segment.kv is None and segment.start_pos != 0:
                raise ValueError("a segment without a KV cache must start at position 0")
        ids = torch.cat([s.input_ids for s in segments])
        # Positions are built on the model's device and bounded in Python (no device-to-host sync on CUDA).
        device = ids.device
        positions = torch.cat(
            [torch.arange(s.start_pos, s.start_pos + s.input_ids.shape[0], device=device) for s in segments]
        )
        last_position = max(s.start_pos + s.input_ids.shape[0] - 1 for s in segments)
        if last_position >= self.config.max_position_embeddings:
            raise ValueError(f"position {last_position} exceeds max_position_embeddings")
        replay = None
        if routed_experts is not None:
            replay = check_routed_experts(routed_experts, len(ids), self.config).to(ids.device)
        x = F.embedding(ids, self.model.embed_tokens.weight)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        picks: list[torch.Tensor] = []
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, _DecoderLayer)
            q, k, v = apply_rowwise(layer.project_qkv, (x, cos, sin), deterministic=deterministic)
            attended = self._attend(index, q, k, v, segments, deterministic)
            if isinstance(layer.mlp, SparseMoeBlock):
                x, h, probs, chosen = apply_rowwise(layer.route, (x, attended), deterministic=deterministic)
                used = chosen if replay is None else replay[:, len(picks)]
                _store_routing(segments, len(picks), used)
                x = layer.mlp.add_output(x, h, probs, used, deterministic=deterministic)
                picks.append(chosen)
            else:
                (x,) = apply_rowwise(layer.finish, (x, attended), deterministic=deterministic)
        (hidden,) = apply_rowwise(self._final_norm, (x,), deterministic=deterministic)
        if picks:
            return ForwardOutput(hidden, torch.stack(picks, dim=1).to(torch.int32))
        return ForwardOutput(hidden, torch.zeros((len(ids), 0, 0), dtype=torch.int32, device=ids.device))

    def _final_norm(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (rms_norm(x, self.model.norm.weight, self.config.rms_norm_eps),)

    def _attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: Sequence[Segment],
        deterministic: bool,
    ) -> torch.Tensor:
        attention = exact_attention if deterministic else fast_attention
        outputs = []
        offset = 0
        for segment in segments:
            n = segment.input_ids.shape[0]
            rows = slice(offset, offset + n)
            offset += n
            if segment.kv is not None:
                segment.kv.write(layer_index, segment.start_pos, k[rows], v[rows])
                keys = segment.kv.keys(layer_index, segment.start_pos + n)
                values = segment.kv.values(layer_index, segment.start_pos + n)
            else:
                keys, values = k[rows], v[rows]
            outputs.append(attention(q[rows], keys, values, segment.start_pos, self.attention_scale))
        return torch.cat(outputs).reshape(q.shape[0], -1)


def _store_routing(segments: Sequence[Segment], moe_layer: int, expert_ids: torch.Tensor) -> None:
    """Write the experts each new token used at one MoE layer into the KV caches that keep routing."""
    offset = 0
    for segment in segments:
        n = segment.input_ids.shape[0]
        if segment.kv is not None and segment.kv.stores_routing:
            segment.kv.write_routing(moe_layer, segment.start_pos, expert_ids[offset : offset + n])
        offset += n
