"""Reading and writing weights: Hugging Face safetensors directories and named-tensor payloads.

A checkpoint directory holds `config.json` and either `model.safetensors`, or shards listed by
`model.safetensors.index.json`, or any set of `*.safetensors` files. Tensor names are Hugging Face's. Weights of
any floating dtype are accepted and cast to float32 (the compute dtype). For tied-embedding models a
`lm_head.weight` entry is ignored, as Hugging Face does; rotary `inv_freq` buffers are ignored too.

Qwen3-MoE experts: our parameters are per expert (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), the
names of Hub checkpoints and of what `save_pretrained` of transformers 5 writes. The fused 3-D tensors of
transformers 5's in-memory modules (`...mlp.experts.gate_up_proj` (E, 2I, H), gate rows first, and
`...mlp.experts.down_proj` (E, H, I)), e.g. a `state_dict()` sent as a weight update, are split into those names.

Updates are all-or-nothing: every name and shape is checked before any parameter changes, so a bad update
leaves the model as it was.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save, save_file

from miles.model.config import ModelConfig
from miles.model.errors import WeightsError
from miles.model.transformer import CausalLM

_INDEX_NAME = "model.safetensors.index.json"
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in a stable order; raises WeightsError when there are none."""
    root = Path(model_dir)
    index = root / _INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [root / name for name in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {root}")
    return files


def read_safetensors_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory by name; raises WeightsError on unreadable files or duplicates."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        try:
            part = load_file(str(path))
        except (OSError, SafetensorError) as exc:
            raise WeightsError(f"cannot read {path}: {exc}") from exc
        duplicates = tensors.keys() & part.keys()
        if duplicates:
            raise WeightsError(f"tensor {sorted(duplicates)[0]!r} appears in more than one file")
        tensors.update(part)
    return tensors


def decode_safetensors_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Named tensors from the bytes of one safetensors file (no pickle: safe on untrusted input)."""
    try:
        return dict(load(data))
    except (SafetensorError, ValueError) as exc:
        raise WeightsError(f"not a valid safetensors payload: {exc}") from exc


def encode_safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The bytes of one safetensors file holding `tensors` (contiguous copies are made as needed)."""
    return save({name: t.detach().contiguous() for name, t in tensors.items()})


def _ignored(name: str, config: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def check_named_tensors(
    model: CausalLM, tensors: Mapping[str, torch.Tensor], *, require_all: bool
) -> dict[str, torch.Tensor]:
    """Validate names and shapes against the model; returns the float32 tensors to load (ignored names dropped)."""
    params = dict(model.named_parameters())
    checked: dict[str, torch.Tensor] = {}
    for name, tensor in split_fused_experts(tensors, model.config).items():
        if _ignored(name, model.config):
            continue
        if name not in params:
            raise WeightsError(f"unknown tensor name {name!r} for this model")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(params[name].shape)}"
            )
        if not tensor.is_floating_point():
            raise WeightsError(f"tensor {name!r} has non-floating dtype {tensor.dtype}")
        checked[name] = tensor.to(torch.float32)
    if require_all:
        missing = sorted(params.keys() - checked.keys())
        if missing:
            raise WeightsError(f"{len(missing)} tensors missing, e.g. {missing[0]!r}")
    return checked


def split_fused_experts(tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors with transformers 5's fused expert tensors replaced by per-expert views (others unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        if tensor.dim() != 3 or tensor.shape[0] != config.num_experts:
            raise WeightsError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected ({config.num_experts}, ., .) experts"
            )
        for expert in range(tensor.shape[0]):
            if kind == "down_proj":
                parts = {"down_proj": tensor[expert]}
            else:
                gate, up = tensor[expert].chunk(2, dim=0)
                parts = {"gate_proj": gate, "up_proj": up}
            for part, value in parts.items():
                split_name = f"{prefix}.{expert}.{part}.weight"
                if split_name in out or split_name in tensors:
                    raise WeightsError(f"tensor {split_name!r} is given both fused and per expert")
                out[split_name] = value
    return out


@torch.no_grad()
def load_named_tensors(model: CausalLM, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> int:
    """Copy tensors into the model's parameters in place (all-or-nothing); returns how many were loaded."""
    checked = check_named_tensors(model, tensors, require_all=require_all)
    params = dict(model.named_parameters())
    for name, tensor in checked.items():
        params[name].copy_(tensor)
    return len(checked)


def load_model(model_dir: str | Path) -> CausalLM:
    """Build the model described by `config.json` and load every weight of the directory into it."""
    model = CausalLM(ModelConfig.from_dir(model_dir))
    load_named_tensors(model, read_safetensors_dir(model_dir), require_all=True)
    model.eval()
    return model


def save_weights(model: CausalLM, out_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write the model's parameters as `model.safetensors` in Hugging Face naming; returns the file path."""
    path = Path(out_dir) / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
