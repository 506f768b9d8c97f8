"""The architecture description of a checkpoint, read from its Hugging Face `config.json`.

Supported: decoder-only transformers of the Llama family as Hugging Face writes them — Qwen3 (RMSNorm, RoPE,
GQA attention with per-head q/k RMSNorm, SwiGLU MLP), Qwen2 (q/k/v bias, no q/k norm), Llama and Mistral
without sliding windows — and Qwen3-MoE (`qwen3_moe`: Qwen3 attention, sparse mixture-of-experts MLPs on the
layers `decoder_sparse_step` and `mlp_only_layers` select, see moe.py). RoPE scaling variants (YaRN, linear,
dynamic, llama3), sliding-window attention and every other MoE architecture (Mixtral, Qwen2-MoE, DeepSeek, ...:
other routers, shared experts, grouped top-k) are refused with a clear error rather than silently computed wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.model.errors import UnsupportedModelError

_ARCH_FLAGS: dict[str, tuple[bool, bool]] = {
    # model_type: (q/k RMSNorm per head, bias on q/k/v projections by default)
    "qwen3": (True, False),
    "qwen2": (False, True),
    "llama": (False, False),
    "mistral": (False, False),
    "qwen3_moe": (True, False),
}

_OTHER_MOE_TYPES = frozenset(
    {
        "mixtral",
        "qwen2_moe",
        "qwen3_next",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe",
        "gpt_oss",
        "olmoe",
        "dbrx",
        "jamba",
        "phimoe",
        "granitemoe",
        "ernie4_5_moe",
        "minimax",
        "llama4",
        "dots1",
        "hunyuan_v1_moe",
    }
)
"""Mixture-of-experts model types whose routers differ from Qwen3-MoE's (shared experts, sigmoid or grouped
routing, expert bias): named in the refusal so that nobody mistakes them for a typo."""

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one decoder-only transformer. Invariant: num_attention_heads is a multiple of
    num_key_value_heads (grouped-query attention)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    architectures: tuple[str, ...]
    num_experts: int = 0
    """Routed experts per sparse layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k) in a sparse layer."""
    moe_intermediate_size: int = 0
    """Width of each expert's SwiGLU MLP (dense layers use intermediate_size)."""
    norm_topk_prob: bool = False
    """Whether the top-k routing weights are renormalised to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers forced to a dense MLP."""

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Indices of the sparse (MoE) decoder layers, ascending: the layer axis of routed-expert arrays."""
        if self.num_experts == 0:
            return ()
        return tuple(
            i
            for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_moe_layers(self) -> int:
        """Number of sparse layers (dense layers are skipped in routed-expert arrays, as SGLang does)."""
        return len(self.moe_layer_indices)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict; raises UnsupportedModelError for anything computed differently."""
        model_type = str(raw.get("model_type", ""))
        if model_type in _OTHER_MOE_TYPES:
            raise UnsupportedModelError(
                f"mixture-of-experts model_type {model_type!r} is not supported (the only MoE architecture "
                "implemented is qwen3_moe)"
            )
        if model_type not in _ARCH_FLAGS:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_ARCH_FLAGS))})"
            )
        qk_norm, default_bias = _ARCH_FLAGS[model_type]
        _refuse_unsupported_features(raw)
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(x) for x in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        bos = raw.get("bos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            architectures=tuple(str(a) for a in raw.get("architectures") or ()),
            **(_moe_fields(raw) if model_type == "qwen3_moe" else {}),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `config.json` of a checkpoint directory."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{path} does not exist")
        return cls.from_dict(json.loads(path.read_text()))


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(raw.get("rope_theta", 10000.0))


def _refuse_unsupported_features(raw: dict[str, Any]) -> None:
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    rope_type = None
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type") or scaling.get("type")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", rope_type)
    if rope_type not in (None, "default"):
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} is not supported")
    if raw.get("use_sliding_window") or (raw.get("model_type") == "mistral" and raw.get("sliding_window")):
        raise UnsupportedModelError("sliding-window attention is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
    if raw.get("model_type") != "qwen3_moe" and any(raw.get(key) for key in _MOE_KEYS):
        raise UnsupportedModelError(
            f"mixture-of-experts layers in model_type {raw.get('model_type')!r} are not supported "
            "(the only MoE architecture implemented is qwen3_moe)"
        )


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's fields with Hugging Face's defaults (Qwen3MoeConfig). transformers >= 5 writes the expert
    count as `num_local_experts`, Hub checkpoints as `num_experts`."""
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)) or 0)
    top_k = int(raw.get("num_experts_per_tok", 8))
    step = int(raw.get("decoder_sparse_step", 1))
    if num_experts < 0 or (num_experts > 0 and not 1 <= top_k <= num_experts):
        raise UnsupportedModelError(f"num_experts_per_tok {top_k} must be in [1, num_experts={num_experts}]")
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k if num_experts > 0 else 0,
        "moe_intermediate_size": int(raw.get("moe_intermediate_size", 768)),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }
