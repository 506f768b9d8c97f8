"""Small random Hugging Face checkpoints (written by transformers itself) for the model library's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}

SMALL_MOE = {
    "head_dim": 32,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
}
"""Qwen3-MoE: sparse layers 0 and 2 around a dense layer 1, top-2 of 8 experts."""


def write_hf_checkpoint(out_dir: Path, family: str, **overrides: Any) -> Path:
    """A randomly initialised checkpoint of `family` (qwen3, qwen3_moe, qwen2, llama) saved by transformers."""
    import transformers

    classes = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, SMALL_MOE),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    }
    config_class, model_class, extra = classes[family]
    torch.manual_seed(0)
    config = config_class(**{**SMALL, **extra, **overrides})
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)  # non-trivial norm weights so the test sees them
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def checkpoint_writer() -> Callable[..., Path]:
    """`write_hf_checkpoint` (fixtures are how tests share helpers under --import-mode=importlib)."""
    return write_hf_checkpoint


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", tie_word_embeddings=True)
