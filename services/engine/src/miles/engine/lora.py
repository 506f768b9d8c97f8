"""LoRA adapters on the torch runner: reading a Hugging Face PEFT adapter directory for the served model, and
serving each loaded adapter with its merged weights.

Exactness: a targeted weight W is served as `merge_lora(W, A, B, scale)` = W + (B @ A) * scale, in the model's
dtype (float32; A and B are converted to it first): PEFT's own merge (`merge_and_unload`: delta = (B @ A) *
scaling, then W += delta), with scale = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. Every other
weight is the base model's, and a sequence of the adapter runs the base model's forward with the merged weights
swapped in, so in deterministic mode its logprobs are bit-identical to those of a model whose checkpoint holds the
merged weights (what a trainer computes with merged weights).

Limits:
- memory: each loaded adapter holds a full copy of every weight it targets (all seven projections of every layer
  is about the size of the decoder's matrices); SGLang keeps only A and B on the GPU and applies them with
  low-rank kernels. The merge runs on the scheduler thread when the adapter is installed, and again for the
  targeted weights after every weight update (an adapter always applies to the weights served now).
- accepted adapters: PEFT `peft_type` LORA on the Linear layers of `SUPPORTED_TARGET_MODULES` (a list of module
  names, not a regex), `bias` "none", no DoRA, no `modules_to_save`, no `rank_pattern` / `alpha_pattern`, no
  `fan_in_fan_out`, weights in `adapter_model.safetensors` (not the legacy .bin). Anything else is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from miles.engine.adapters import SUPPORTED_TARGET_MODULES, AdapterLimits, LoraError

_PEFT_PREFIX = "base_model.model."
_FACTOR_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}


@dataclass(frozen=True)
class PreparedAdapter:
    """A checked adapter: scale and, per targeted base weight name, its (A (r, in), B (out, r)) in float32."""

    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The weight an adapter serves: W + (B @ A) * scale, computed as PEFT merges it."""
    return weight + (b @ a) * scale


def read_adapter(lora_path: str, shapes: dict[str, tuple[int, ...]], limits: AdapterLimits) -> PreparedAdapter:
    """Read a PEFT LoRA directory for a model whose weights have `shapes` (by Hugging Face name); LoraError when it
    cannot be served."""
    path = Path(lora_path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise LoraError(f"{lora_path} is not a LoRA adapter directory: it has no adapter_config.json")
    if not weights_file.is_file():
        raise LoraError(f"{lora_path} has no adapter_model.safetensors (only safetensors adapters are supported)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise LoraError(f"{config_file} is not JSON: {exc}") from exc
    rank, scale, targets = _check_config(config, lora_path, limits)
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises several types for a broken file
        raise LoraError(f"cannot read {weights_file}: {exc}") from exc
    factors = _factors(tensors, rank, targets, shapes, lora_path)
    return PreparedAdapter(scale, factors)


def _check_config(config: Any, lora_path: str, limits: AdapterLimits) -> tuple[int, float, frozenset[str]]:
    """(r, scale, target modules) of an adapter_config.json that this engine can serve."""
    if not isinstance(config, dict):
        raise LoraError(f"{lora_path}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{lora_path} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoraError(f"{lora_path}: r must be a positive integer and lora_alpha a number")
    for key, allowed in (("use_dora", (False, None)), ("fan_in_fan_out", (False, None)), ("bias", ("none", None))):
        if config.get(key) not in allowed:
            raise LoraError(f"{lora_path}: {key}={config.get(key)!r} is not supported by miles-engine")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(key):
            raise LoraError(f"{lora_path}: {key} is not supported by miles-engine")
    if limits.max_lora_rank is not None and rank > limits.max_lora_rank:
        raise LoraError(
            f"LoRA adapter {lora_path} with rank {rank} is incompatible with the current configuration: its rank is "
            f"above --max-lora-rank {limits.max_lora_rank}."
        )
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{lora_path}: target_modules must be a list of module names (a regex is not supported)")
    unknown = sorted({t.split(".")[-1] for t in targets} - set(SUPPORTED_TARGET_MODULES))
    if unknown:
        raise LoraError(
            f"LoRA adapter {lora_path} targets modules {unknown} that miles-engine does not support; supported: "
            f"{list(SUPPORTED_TARGET_MODULES)}"
        )
    outside = sorted({t.split(".")[-1] for t in targets} - limits.target_modules)
    if outside:
        raise LoraError(
            f"LoRA adapter {lora_path} contains target modules {outside} that are not included in the specified "
            f"--lora-target-modules {sorted(limits.target_modules)}."
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale), frozenset(t.split(".")[-1] for t in targets)


def _factors(
    tensors: dict[str, torch.Tensor],
    rank: int,
    targets: frozenset[str],
    shapes: dict[str, tuple[int, ...]],
    lora_path: str,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pair lora_A / lora_B per base weight and check them against the base model's shapes."""
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _FACTOR_SUFFIXES if key.endswith(s)), None)
        module = key.removeprefix(_PEFT_PREFIX)[: -len(suffix)] if suffix else ""
        weight_name = f"{module}.weight"
        if suffix is None or weight_name not in shapes or module.split(".")[-1] not in targets:
            raise LoraError(f"LoRA adapter {lora_path}: tensor {key!r} does not match a target module of this model")
        pairs.setdefault(weight_name, [None, None])[_FACTOR_SUFFIXES[suffix]] = tensor
    if not pairs:
        raise LoraError(f"LoRA adapter {lora_path} holds no LoRA weights")
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in pairs.items():
        out_features, in_features = shapes[name]
        if a is None or b is None:
            raise LoraError(f"LoRA adapter {lora_path}: {name} has only one of lora_A and lora_B")
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoraError(
                f"LoRA adapter {lora_path} does not fit the base model: {name} is {out_features}x{in_features}, so "
                f"lora_A must be {rank}x{in_features} and lora_B {out_features}x{rank}, got "
                f"{list(a.shape)} and {list(b.shape)}"
            )
        factors[name] = (a.to(torch.float32), b.to(torch.float32))
    return factors


class MergedAdapters:
    """The installed adapters of one model: merged weights per adapter, swapped in for its sequences' forward."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._prepared: dict[str, PreparedAdapter] = {}
        self._merged: dict[str, dict[str, nn.Parameter]] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self._model.named_parameters()}

    def add(self, lora_id: str, prepared: PreparedAdapter) -> None:
        params = dict(self._model.named_parameters())
        device = next(iter(params.values())).device
        moved = {name: (a.to(device), b.to(device)) for name, (a, b) in prepared.factors.items()}
        adapter = PreparedAdapter(prepared.scale, moved)
        with torch.no_grad():
            merged = {
                name: nn.Parameter(merge_lora(params[name], a, b, adapter.scale), requires_grad=False)
                for name, (a, b) in moved.items()
            }
        self._prepared[lora_id], self._merged[lora_id] = adapter, merged

    def remove(self, lora_id: str) -> None:
        self._prepared.pop(lora_id, None)
        self._merged.pop(lora_id, None)

    def refresh(self, names: set[str]) -> None:
        """Merge again the targeted weights among `names` (just updated in the base model)."""
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for lora_id, adapter in self._prepared.items():
                for name in names & adapter.factors.keys():
                    a, b = adapter.factors[name]
                    self._merged[lora_id][name].copy_(merge_lora(params[name], a, b, adapter.scale))

    @contextlib.contextmanager
    def swapped(self, lora_id: str | None) -> Iterator[None]:
        """The model serves `lora_id`'s merged weights inside the block (the base weights without an id)."""
        if lora_id is None:
            yield
            return
        merged = self._merged[lora_id]
        originals: list[tuple[nn.Module, nn.Parameter | None]] = []
        try:
            for name, weight in merged.items():
                module = self._model.get_submodule(name.removesuffix(".weight"))
                originals.append((module, module._parameters["weight"]))
                module._parameters["weight"] = weight
            yield
        finally:
            for module, original in originals:
                module._parameters["weight"] = original
