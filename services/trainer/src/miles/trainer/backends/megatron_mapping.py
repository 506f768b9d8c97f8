"""Hugging Face <-> Megatron-core tensor names and layouts for Llama-family decoders (Qwen3, Qwen2, Llama,
Mistral) and Qwen3-MoE, in the layout of a GPTModel built with the local layer spec at tensor-, pipeline- and
expert-parallel size 1 (the *global* names and shapes; `megatron_shards.py` cuts them into each rank's shards).
Pure tensor code: no Megatron import, so it is unit-tested on its own.

| Hugging Face                                   | Megatron-core                                            |
|------------------------------------------------|----------------------------------------------------------|
| model.embed_tokens.weight                      | embedding.word_embeddings.weight                         |
| model.layers.i.input_layernorm.weight          | decoder.layers.i.input_layernorm.weight                  |
| model.layers.i.self_attn.{q,k,v}_proj.weight   | decoder.layers.i.self_attention.linear_qkv.weight (*)    |
| model.layers.i.self_attn.{q,k,v}_proj.bias     | decoder.layers.i.self_attention.linear_qkv.bias (*)      |
| model.layers.i.self_attn.o_proj.weight         | decoder.layers.i.self_attention.linear_proj.weight       |
| model.layers.i.self_attn.{q,k}_norm.weight     | decoder.layers.i.self_attention.{q,k}_layernorm.weight   |
| model.layers.i.post_attention_layernorm.weight | decoder.layers.i.pre_mlp_layernorm.weight                |
| model.layers.i.mlp.{gate,up}_proj.weight       | decoder.layers.i.mlp.linear_fc1.weight = [gate; up]      |
| model.layers.i.mlp.down_proj.weight            | decoder.layers.i.mlp.linear_fc2.weight                   |
| model.layers.i.mlp.gate.weight (MoE router)    | decoder.layers.i.mlp.router.weight                       |
| model.layers.i.mlp.experts.e.{gate,up}_proj    | decoder.layers.i.mlp.experts.local_experts.e.linear_fc1  |
|   .weight (MoE)                                |   .weight = [gate; up]                                   |
| model.layers.i.mlp.experts.e.down_proj.weight  | decoder.layers.i.mlp.experts.local_experts.e.linear_fc2  |
|                                                |   .weight                                                |
| model.norm.weight                              | decoder.final_layernorm.weight                           |
| lm_head.weight (untied models only)            | output_layer.weight                                      |

(*) Megatron fuses q, k and v grouped by key/value head: for each of the `num_kv_heads` groups, that group's
`heads_per_group` query heads, then its key head, then its value head (each `head_dim` rows).

A layer is mapped as MoE when its router is among the tensors (`mlp.gate.weight` one way, `mlp.router.weight`
the other) and as a dense MLP otherwise, so a Qwen3-MoE checkpoint's `mlp_only_layers` / `decoder_sparse_step`
dense layers map like any dense layer; the expert count is the router's row count.

`hf_to_megatron` / `megatron_to_hf` map whole state dicts; `megatron_tensor` builds one global Megatron tensor
from the HF tensors it is made of, read on demand (so a rank reads only what its shards need).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionLayout:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """HF q/k/v (weights (rows, hidden) or biases (rows,)) -> Megatron's grouped linear_qkv tensor."""
    tail = q.shape[1:]
    q_groups = q.reshape(layout.num_kv_heads, layout.heads_per_group * layout.head_dim, *tail)
    k_groups = k.reshape(layout.num_kv_heads, layout.head_dim, *tail)
    v_groups = v.reshape(layout.num_kv_heads, layout.head_dim, *tail)
    return torch.cat([q_groups, k_groups, v_groups], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, layout: AttentionLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv."""
    tail = qkv.shape[1:]
    q_rows = layout.heads_per_group * layout.head_dim
    groups = qkv.reshape(layout.num_kv_heads, q_rows + 2 * layout.head_dim, *tail)
    q = groups[:, :q_rows].reshape(-1, *tail)
    k = groups[:, q_rows : q_rows + layout.head_dim].reshape(-1, *tail)
    v = groups[:, q_rows + layout.head_dim :].reshape(-1, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def hf_to_megatron(
    tensors: dict[str, torch.Tensor], layout: AttentionLayout, num_layers: int, *, tied: bool
) -> dict[str, torch.Tensor]:
    """Megatron state-dict entries for an HF checkpoint's tensors (all of them must be present)."""
    out: dict[str, torch.Tensor] = {}
    for hf_name, mg_name in _TOP_RENAMES.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        out[mg_name] = tensors[hf_name]
    for i in range(num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in _LAYER_RENAMES.items():
            if hf + hf_suffix in tensors:
                out[mg + mg_suffix] = tensors[hf + hf_suffix]
        attn = hf + "self_attn."
        for kind in ("weight", "bias"):
            if f"{attn}q_proj.{kind}" in tensors:
                out[f"{mg}self_attention.linear_qkv.{kind}"] = fuse_qkv(
                    tensors[f"{attn}q_proj.{kind}"],
                    tensors[f"{attn}k_proj.{kind}"],
                    tensors[f"{attn}v_proj.{kind}"],
                    layout,
                )
        out |= _mlp_to_megatron(tensors, hf + "mlp.", mg + "mlp.")
    return out


def _mlp_to_megatron(tensors: dict[str, torch.Tensor], hf: str, mg: str) -> dict[str, torch.Tensor]:
    """One layer's MLP (dense, or router + experts); `down_proj` of a dense MLP is renamed with the layer."""
    router = tensors.get(hf + "gate.weight")
    if router is None:
        return {mg + "linear_fc1.weight": torch.cat([tensors[hf + "gate_proj.weight"], tensors[hf + "up_proj.weight"]])}
    out = {mg + "router.weight": router}
    for e in range(router.shape[0]):
        expert, local = f"{hf}experts.{e}.", f"{mg}experts.local_experts.{e}."
        out[local + "linear_fc1.weight"] = torch.cat(
            [tensors[expert + "gate_proj.weight"], tensors[expert + "up_proj.weight"]]
        )
        out[local + "linear_fc2.weight"] = tensors[expert + "down_proj.weight"]
    return out


def _mlp_to_hf(tensors: dict[str, torch.Tensor], mg: str, hf: str) -> dict[str, torch.Tensor]:
    """Inverse of _mlp_to_megatron."""
    router = tensors.get(mg + "router.weight")
    if router is None:
        return _split_fc1(tensors[mg + "linear_fc1.weight"], hf)
    out = {hf + "gate.weight": router}
    for e in range(router.shape[0]):
        expert, local = f"{hf}experts.{e}.", f"{mg}experts.local_experts.{e}."
        out |= _split_fc1(tensors[local + "linear_fc1.weight"], expert)
        out[expert + "down_proj.weight"] = tensors[local + "linear_fc2.weight"]
    return out


def _split_fc1(fc1: torch.Tensor, hf: str) -> dict[str, torch.Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return {hf + "gate_proj.weight": gate.contiguous(), hf + "up_proj.weight": up.contiguous()}


def megatron_to_hf(
    tensors: dict[str, torch.Tensor], layout: AttentionLayout, num_layers: int, *, tied: bool
) -> dict[str, torch.Tensor]:
    """HF tensors from a Megatron state dict (inverse of hf_to_megatron; `_extra_state` entries ignored)."""
    out: dict[str, torch.Tensor] = {}
    for hf_name, mg_name in _TOP_RENAMES.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        out[hf_name] = tensors[mg_name]
    for i in range(num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in _LAYER_RENAMES.items():
            if mg + mg_suffix in tensors:
                out[hf + hf_suffix] = tensors[mg + mg_suffix]
        for kind in ("weight", "bias"):
            fused = tensors.get(f"{mg}self_attention.linear_qkv.{kind}")
            if fused is not None:
                q, k, v = split_qkv(fused, layout)
                out[f"{hf}self_attn.q_proj.{kind}"] = q
                out[f"{hf}self_attn.k_proj.{kind}"] = k
                out[f"{hf}self_attn.v_proj.{kind}"] = v
        out |= _mlp_to_hf(tensors, mg + "mlp.", hf + "mlp.")
    return out


_HF_OF_TOP = {mg: hf for hf, mg in _TOP_RENAMES.items()}
_HF_OF_LAYER = {mg: hf for hf, mg in _LAYER_RENAMES.items()}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


def megatron_tensor(name: str, read: Callable[[str], torch.Tensor], layout: AttentionLayout) -> torch.Tensor:
    """The global Megatron tensor `name` (a name of the size-1 layout) from the HF tensors `read` returns by
    name; the same values as `hf_to_megatron(...)[name]`."""
    if name in _HF_OF_TOP:
        return read(_HF_OF_TOP[name])
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        raise KeyError(f"no Hugging Face source for Megatron tensor {name!r}")
    hf, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    if suffix in _HF_OF_LAYER:
        return read(hf + _HF_OF_LAYER[suffix])
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        attn = hf + "self_attn."
        return fuse_qkv(
            read(f"{attn}q_proj.{kind}"), read(f"{attn}k_proj.{kind}"), read(f"{attn}v_proj.{kind}"), layout
        )
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([read(hf + "mlp.gate_proj.weight"), read(hf + "mlp.up_proj.weight")])
    if suffix == "mlp.router.weight":
        return read(hf + "mlp.gate.weight")
    expert = _EXPERT_NAME.fullmatch(suffix)
    if expert is None:
        raise KeyError(f"no Hugging Face source for Megatron tensor {name!r}")
    source = f"{hf}mlp.experts.{expert.group(1)}."
    if expert.group(2) == "linear_fc2":
        return read(source + "down_proj.weight")
    return torch.cat([read(source + "gate_proj.weight"), read(source + "up_proj.weight")])
