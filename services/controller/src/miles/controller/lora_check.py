"""LoRA choices checked at submission (400 naming the field): against the model's config.json, and against the
shared engine pool the job runs on (`check_shared_pool`).

The controller reads the checkpoint's config.json when it can (a local path or a mounted volume); the trainer checks
the same against the loaded model at start, so a model the controller cannot read is checked there instead.
Checked here: every target module is a linear layer the architecture has, and the rank fits every targeted layer
(rank <= min(in_features, out_features), else B @ A cannot be of full rank r and the adapter wastes parameters).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles.common.errors import InvalidArgumentError
from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import SharedPool

_MAX_CONFIG_BYTES = 1 << 20
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
LINEAR_NAMES: dict[str, tuple[str, ...]] = {
    model_type: _ATTENTION + _MLP for model_type in ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")
}
"""Adaptable linear layers by config.json model_type (the Hugging Face names the trainer's model uses)."""


def read_config(model_path: str) -> dict[str, Any] | None:
    """config.json as a dict, None when this process cannot read it (the trainer checks at start then)."""
    path = Path(model_path) / "config.json"
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _layer_dims(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer name (an MoE's expert MLPs use moe_intermediate_size)."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    mlp = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    mlp = min(mlp, int(config.get("intermediate_size") or mlp))
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, mlp),
        "up_proj": (hidden, mlp),
        "down_proj": (mlp, hidden),
    }


def check_lora(spec: JobSpec, config: dict[str, Any] | None) -> None:
    """InvalidArgumentError (400) for target modules the model lacks or a rank that does not fit them."""
    lora = spec.train.lora
    if lora is None or config is None or config.get("model_type") not in LINEAR_NAMES:
        return
    known = LINEAR_NAMES[str(config["model_type"])]
    unknown = [name for name in lora.target_modules if name not in known]
    if unknown:
        raise InvalidArgumentError(
            f"train.lora.target_modules {unknown} are not linear layers of a {config['model_type']} model; it has "
            f"{list(known)}",
            field="train.lora.target_modules",
        )
    try:
        dims = _layer_dims(config)
    except (KeyError, TypeError, ValueError):
        return  # an unusual config: the trainer checks against the loaded model
    smallest = min(min(dims[name]) for name in lora.target_modules)
    if lora.rank > smallest:
        raise InvalidArgumentError(
            f"train.lora.rank {lora.rank} does not fit: the smallest targeted layer has {smallest} features, so the "
            f"rank can be at most {smallest}",
            field="train.lora.rank",
        )


def check_shared_pool(spec: JobSpec, pools: Sequence[SharedPool]) -> SharedPool | None:
    """The shared pool `spec` runs on (None: the job has its own engines); InvalidArgumentError (400) when the pool
    is not declared or cannot serve the job's adapters (another base model, a higher rank, other target modules)."""
    name = spec.resources.engines.shared_pool
    if name is None:
        return None
    pool = next((pool for pool in pools if pool.name == name), None)
    if pool is None:
        declared = [pool.name for pool in pools]
        raise InvalidArgumentError(
            f"no shared engine pool {name!r}; the platform declares {declared} (controller setting shared_pools)",
            field="resources.engines.shared_pool",
        )
    lora = spec.train.lora
    assert lora is not None, "placement_problems: a shared pool needs train.lora"
    if spec.model.path != pool.model_path:
        raise InvalidArgumentError(
            f"shared pool {name!r} serves the base model {pool.model_path!r}, not {spec.model.path!r}: an adapter "
            "trained on another base model cannot be served by it",
            field="model.path",
        )
    if lora.rank > pool.max_lora_rank:
        raise InvalidArgumentError(
            f"train.lora.rank {lora.rank} exceeds shared pool {name!r}'s max_lora_rank {pool.max_lora_rank}",
            field="train.lora.rank",
        )
    outside = [module for module in lora.target_modules if module not in pool.lora_target_modules]
    if outside:
        raise InvalidArgumentError(
            f"train.lora.target_modules {outside} are not served by shared pool {name!r}; it serves adapters on "
            f"{pool.lora_target_modules}",
            field="train.lora.target_modules",
        )
    return pool
