"""Our torch implementation of the Llama-family decoder (Qwen3 first), with Hugging Face parameter names.

Parameter names equal the Hugging Face checkpoint's (`model.layers.0.self_attn.q_proj.weight`, ...), so a
safetensors directory loads by name and `state_dict()` saves one that Hugging Face loads back.

One forward serves every caller:
- the engine: `forward_segments` over several sequences at once, each a `Segment` of new tokens appended at
  `start_pos` to a `SequenceKV` (prefill of uncached suffixes and single-token decode are the same call);
- the trainer: `forward(input_ids)` on one full sequence without a cache, differentiable.
With `deterministic=True` both give bit-identical hidden states for the same token at the same position,
whatever else is in the batch and however the sequence was split into segments (see `kernels.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from miles.model.attention import exact_attention, fast_attention
from miles.model.config import ModelConfig
from miles.model.kernels import apply_rope, apply_rowwise, linear, rms_norm, rope_tables, single_threaded
from miles.model.kv_cache import SequenceKV


@dataclass
class Segment:
    """New tokens of one sequence: `input_ids` (n,) int64 at positions [start_pos, start_pos + n).

    With `kv`, positions before start_pos are read from it and the new keys/values are written into it;
    without, start_pos must be 0 (the whole sequence is in input_ids).
    """

    input_ids: torch.Tensor
    start_pos: int = 0
    kv: SequenceKV | None = None


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=torch.float32))


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))


class _Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num, dim)


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.q_proj = _Linear(c.hidden_size, c.num_attention_heads * c.head_dim, c.attention_bias)
        self.k_proj = _Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.v_proj = _Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, c.attention_bias)
        self.o_proj = _Linear(c.num_attention_heads * c.head_dim, c.hidden_size, False)
        if c.qk_norm:
            self.q_norm = _Norm(c.head_dim)
            self.k_norm = _Norm(c.head_dim)


class _Mlp(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = _Linear(config.hidden_size, config.intermediate_size, False)
        self.up_proj = _Linear(config.hidden_size, config.intermediate_size, False)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, False)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = _Norm(config.hidden_size)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _Norm(config.hidden_size)
        self.mlp = _Mlp(config)

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
        """Row-wise: output projection, residual, MLP, residual."""
        x = x + self.self_attn.o_proj(attended)
        h = rms_norm(x, self.post_attention_layernorm.weight, self.config.rms_norm_eps)
        mlp = self.mlp
        return (x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)),)


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([_DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = _Norm(config.hidden_size)


class CausalLM(nn.Module):
    """A decoder-only language model; float32 on the CPU. Weights start at zero: load them (checkpoint.py)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = None if config.tie_word_embeddings else _Linear(config.hidden_size, config.vocab_size, False)
        cos, sin = rope_tables(config.head_dim, config.rope_theta, config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.attention_scale = config.head_dim**-0.5

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The (vocab_size, hidden_size) output projection (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, *, deterministic: bool = False) -> torch.Tensor:
        """Final-normed hidden states (T, hidden) of one whole sequence `input_ids` (T,); differentiable."""
        return self.forward_segments([Segment(input_ids)], deterministic=deterministic)

    def forward_segments(self, segments: Sequence[Segment], *, deterministic: bool = False) -> torch.Tensor:
        """Final-normed hidden states of every new token of every segment, concatenated in segment order."""
        if deterministic:
            with single_threaded():
                return self._forward_segments(segments, deterministic=True)
        return self._forward_segments(segments, deterministic=False)

    def _forward_segments(self, segments: Sequence[Segment], *, deterministic: bool) -> torch.Tensor:
        for segment in segments:
            if segment.kv is None and segment.start_pos != 0:
                raise ValueError("a segment without a KV cache must start at position 0")
        ids = torch.cat([s.input_ids for s in segments])
        positions = torch.cat([torch.arange(s.start_pos, s.start_pos + s.input_ids.shape[0]) for s in segments])
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} exceeds max_position_embeddings")
        x = F.embedding(ids, self.model.embed_tokens.weight)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, _DecoderLayer)
            q, k, v = apply_rowwise(layer.project_qkv, (x, cos, sin), deterministic=deterministic)
            attended = self._attend(index, q, k, v, segments, deterministic)
            (x,) = apply_rowwise(layer.finish, (x, attended), deterministic=deterministic)
        (hidden,) = apply_rowwise(self._final_norm, (x,), deterministic=deterministic)
        return hidden

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
