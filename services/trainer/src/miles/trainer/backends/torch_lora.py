"""LoRA for the torch backend, through the `peft` library: adapters injected into miles.model's linear layers,
the base frozen, and the conversions a trainer needs (merged weights to publish, the adapter to checkpoint).

How it fits miles.model: its projections are `miles.model.layers.Linear` (a parameter holder whose forward is
`F.linear`), which peft does not know. Each targeted one is swapped for a `torch.nn.Linear` that holds the *same*
parameters (same forward, same names), and peft's `inject_adapter_in_model` wraps those in place, so the model
keeps its own class and forward and gains `<layer>.base_layer.weight`, `<layer>.lora_A.default.weight` (r x in)
and `<layer>.lora_B.default.weight` (out x r); peft freezes every other parameter.

Exactness: with dropout 0, each adapted layer computes `F.linear(x, W + (B @ A) * scaling)` (`ExactLoraLinear`,
the merged weight built from peft's own `get_delta_weight`) rather than peft's `x W^T + (x A^T B^T) * scaling`,
whose sum rounds differently. `merged_hf_tensors` builds the published weights with the same operations, so the
trainer's logprobs are bit-identical to those of a plain model loaded with the published float32 weights, in
deterministic mode and out (same kernels, one process, same device). The cost: one (out x in) weight is built per
adapted layer and forward call (per 32-row block in deterministic mode), and its gradient is full-sized while the
backward runs (never stored: only A and B have gradients and optimizer state). With dropout > 0 training forwards
use peft's unmerged path (stochastic, so not exact).

Limits: single process only (the trainer refuses LoRA with world_size > 1 and with sharded checkpoints); adapters
on the linear layers a decoder layer calls (`lm_head` is read as a matrix by the LM-head kernel, the embedding is
a lookup: neither can be adapted); no bias adapters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import LoraConfig
from miles.model import CausalLM
from miles.model.layers import Linear as MilesLinear

ADAPTER = "default"
"""peft's adapter name (the only adapter)."""

PEFT_PREFIX = "base_model.model."
"""Prefix of the tensor names in a PEFT `adapter_model.safetensors` (what `PeftModel.save_pretrained` writes)."""

_UNADAPTABLE = frozenset({"lm_head"})
"""Linear layers whose weight the model reads directly (no module call, so an adapter would never run)."""


class ExactLoraLinear(PeftLoraLinear):
    """peft's LoRA linear layer, computing through the merged weight whenever no dropout acts (see the module
    docstring); otherwise (dropout in training, disabled or merged adapters) exactly peft's forward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.disable_adapters or self.merged or args or kwargs or not self._dropout_free():
            result: torch.Tensor = super().forward(x, *args, **kwargs)
            return result
        bias = cast("torch.Tensor | None", self.get_base_layer().bias)
        return F.linear(x, merged_weight(self), bias)

    def _dropout_free(self) -> bool:
        return all(
            isinstance(self.lora_dropout[name], nn.Identity) or not self.training
            for name in self.active_adapters
            if name in self.lora_A
        )


def merged_weight(layer: PeftLoraLinear) -> torch.Tensor:
    """W + (B @ A) * scaling of every active adapter, in float32 whatever autocast is on (differentiable)."""
    weight = cast(torch.Tensor, layer.get_base_layer().weight)
    with torch.autocast(device_type=weight.device.type, enabled=False):
        for name in layer.active_adapters:
            if name in layer.lora_A:
                weight = weight + layer.get_delta_weight(name)
    return weight


def adaptable_names(lm: nn.Module) -> set[str]:
    """Last name component of every linear layer of the model that an adapter can target."""
    names = {name.rsplit(".", 1)[-1] for name, module in lm.named_modules() if isinstance(module, MilesLinear)}
    return names - _UNADAPTABLE


def check_targets(config: LoraConfig, lm: nn.Module) -> None:
    """Raises ConfigError (field train.lora.target_modules) for a name that matches no adaptable linear layer."""
    known = adaptable_names(lm)
    unknown = [name for name in config.target_modules if name not in known]
    if unknown:
        raise ConfigError(
            f"train.lora.target_modules {unknown} match no adaptable linear layer of this model; it has "
            f"{sorted(known)} (lm_head and the embedding cannot be adapted)",
            field="train.lora.target_modules",
        )


def peft_config(config: LoraConfig, base_model_path: Path | None = None) -> PeftLoraConfig:
    """The peft LoraConfig of a job's LoRA section (also what adapter_config.json holds)."""
    result = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,  # type: ignore[arg-type]  # annotated int; peft computes alpha / r in floats
        target_modules=list(config.target_modules),
        lora_dropout=config.dropout,
        use_rslora=config.use_rslora,
        bias="none",
        base_model_name_or_path=str(base_model_path) if base_model_path is not None else None,
    )
    result._register_custom_module({nn.Linear: ExactLoraLinear})
    return result


def adapter_config_dict(config: LoraConfig, base_model_path: Path | None) -> dict[str, Any]:
    """adapter_config.json's content (JSON-ready), as peft's save_pretrained writes it."""
    raw: dict[str, Any] = peft_config(config, base_model_path).to_dict()  # type: ignore[no-untyped-call]
    return {key: sorted(value) if isinstance(value, set) else value for key, value in raw.items()}


def apply_lora(lm: CausalLM, config: LoraConfig, *, seed: int) -> None:
    """Check the targets, then adapt the model in place: base frozen, adapters (B = 0, so the model is unchanged)
    trainable, on the device of the base weights. A's random init (peft's Kaiming-uniform) is drawn from `seed`
    without touching the global RNG, so a job's adapters start the same on every run."""
    check_targets(config, lm)
    targets = set(config.target_modules)
    for name, module in list(lm.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if leaf in targets and isinstance(module, MilesLinear):
            lm.get_submodule(parent_name).register_module(leaf, _as_torch_linear(module))
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(config), lm, adapter_name=ADAPTER)
    lm.requires_grad_(False)
    for module in lm.modules():
        if isinstance(module, PeftLoraLinear):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)


def _as_torch_linear(module: MilesLinear) -> nn.Linear:
    """An nn.Linear holding `module`'s own parameters (no copy; F.linear either way)."""
    out_features, in_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=module.bias is not None, device="meta")
    linear.weight = module.weight
    linear.register_parameter("bias", module.bias)
    return linear


def lora_layers(lm: nn.Module) -> Iterable[tuple[str, PeftLoraLinear]]:
    return ((name, m) for name, m in lm.named_modules() if isinstance(m, PeftLoraLinear))


def merged_hf_tensors(lm: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight under its Hugging Face name, adapted layers merged (W + (B @ A) * scaling, computed on the
    weights' device as the forward computes it), float32 on the CPU."""
    merged = {}
    with torch.no_grad():
        for name, layer in lora_layers(lm):
            merged[f"{name}.weight"] = merged_weight(layer).detach().float().cpu().clone()
    result: dict[str, torch.Tensor] = {}
    for name, param in lm.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        hf_name = name.replace(".base_layer.", ".")
        result[hf_name] = merged.get(hf_name, param.detach().float().cpu().clone())
    return result


def adapter_tensors(lm: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's file names (`base_model.model.<layer>.lora_A.weight`), float32 CPU."""
    params = dict(lm.named_parameters())
    return {name: params[_param_name(name)].detach().float().cpu().clone() for name in _file_names(params)}


def load_adapter_tensors(lm: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy an `adapter_tensors` dict (e.g. a checkpoint's adapter_model.safetensors) into the adapters. Raises
    ConfigError when its names are not exactly this model's adapters (another target_modules or model)."""
    params = dict(lm.named_parameters())
    wanted, given = set(_file_names(params)), set(tensors)
    if given != wanted:
        missing, extra = sorted(wanted - given)[:3], sorted(given - wanted)[:3]
        raise ConfigError(
            f"the checkpoint's adapter does not fit train.lora (missing {missing}, unexpected {extra}): was it "
            "written with other target_modules or another model?",
            field="train.lora",
        )
    with torch.no_grad():
        for file_name, tensor in tensors.items():
            param = params[_param_name(file_name)]
            if param.shape != tensor.shape:
                raise ConfigError(
                    f"adapter tensor {file_name} has shape {tuple(tensor.shape)}, train.lora needs "
                    f"{tuple(param.shape)} (another rank?)",
                    field="train.lora.rank",
                )
            param.copy_(tensor.to(param.dtype))


def _file_names(params: Mapping[str, torch.Tensor]) -> list[str]:
    """PEFT file names of the adapter parameters among `params` (named as in the injected model)."""
    suffix = f".{ADAPTER}.weight"
    return [
        PEFT_PREFIX + name.removesuffix(suffix) + ".weight"
        for name in params
        if (".lora_A." in name or ".lora_B." in name) and name.endswith(suffix)
    ]


def _param_name(file_name: str) -> str:
    return file_name.removeprefix(PEFT_PREFIX).removesuffix(".weight") + f".{ADAPTER}.weight"
