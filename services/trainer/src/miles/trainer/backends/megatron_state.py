"""Weights and optimizer state of a multi-rank Megatron backend in the single-rank formats, gathered to rank 0
and scattered from it shard by shard (`megatron_shards.py`).

- Weights: `gathered_hf_state` gives the Hugging Face tensors on rank 0, bit-identical to what a TP = PP = EP = 1
  backend holding the same values exports; `scatter_hf_state` loads HF tensors that only rank 0 holds.
- Optimizer: the same dict `common.full_optimizer_state` gives for a single-rank model (torch's
  `get_optimizer_state_dict` layout: `state` keyed by the global parameter name with whole `exp_avg`,
  `exp_avg_sq` and `step`, `param_groups` listing names), so a checkpoint resumes at any layout, TP = 1 included.
  Every parameter takes every optimizer step here (`finalize_grads` gives missing gradients zeros), so one step
  count holds for all; rank 0's is written for every name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles.model import ModelConfig
from miles.trainer.backends.megatron_mapping import AttentionLayout, megatron_tensor, megatron_to_hf
from miles.trainer.backends.megatron_shards import ShardSpec, gather_full, scatter_full

Params = Sequence[tuple[ShardSpec, torch.nn.Parameter]]
_MOMENTS = ("exp_avg", "exp_avg_sq")


def gathered_hf_state(params: Params, config: ModelConfig, attention: AttentionLayout) -> dict[str, torch.Tensor]:
    """The whole model under HF names on rank 0 (an empty dict on the other ranks). Collective."""
    full = gather_full([(spec, param) for spec, param in params])
    if not full:
        return {}
    return megatron_to_hf(full, attention, config.num_hidden_layers, tied=config.tie_word_embeddings)


def scatter_hf_state(params: Params, tensors: Mapping[str, torch.Tensor], attention: AttentionLayout) -> None:
    """Load HF tensors read on rank 0 (the other ranks pass an empty mapping) into every rank's shards."""
    scatter_full(list(params), lambda name: megatron_tensor(name, tensors.__getitem__, attention))


def gathered_optimizer_state(
    params: Params, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> dict[str, Any]:
    """Optimizer and scheduler state in the single-rank layout, meaningful on rank 0. Collective."""
    states = [optimizer.state.get(param, {}) for _, param in params]
    stepped = bool(states) and all("exp_avg" in state for state in states)
    steps = {float(state["step"]) for state in states if "step" in state}
    if len(steps) > 1:
        raise RuntimeError(f"parameters of this rank took different numbers of optimizer steps: {sorted(steps)}")
    moments = {}
    if stepped:
        for key in _MOMENTS:
            moments[key] = gather_full([(spec, state[key]) for (spec, _), state in zip(params, states, strict=True)])
    state_by_name: dict[str, Any] = {}
    if moments.get("exp_avg"):
        step = torch.tensor(steps.pop(), dtype=torch.float32)
        state_by_name = {
            name: {"step": step.clone(), "exp_avg": whole, "exp_avg_sq": moments["exp_avg_sq"][name]}
            for name, whole in moments["exp_avg"].items()
        }
    names = _global_names(params)
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    groups[0]["params"] = names
    return {"optimizer": {"state": state_by_name, "param_groups": groups}, "scheduler": scheduler.state_dict()}


def _global_names(params: Params) -> list[str]:
    """Every exported global parameter name, each once, in rank order (collective)."""
    local = [spec.global_name for spec, _ in params if spec.exported]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return list(dict.fromkeys(name for names in gathered for name in names))


def load_gathered_optimizer_state(
    params: Params,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
) -> None:
    """Restore what `gathered_optimizer_state` (or a single-rank backend) wrote; the optimizer part is read on rank
    0 only (the others get the scheduler state alone, from the rank-0 broadcast of distributed.py). Collective."""
    saved = state.get("optimizer") or {}
    by_name: dict[str, Any] = saved.get("state", {})
    header: list[Any] = [None]
    if dist.get_rank() == 0:
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in saved.get("param_groups", [])]
        step = float(next(iter(by_name.values()))["step"]) if by_name else None
        header = [(hyper, step)]
    dist.broadcast_object_list(header, src=0)
    hyper, step = header[0]
    for group, values in zip(optimizer.param_groups, hyper, strict=False):
        group.update(values)
    optimizer.state.clear()
    if step is not None:
        for key in _MOMENTS:
            buffers = [(spec, torch.zeros_like(param)) for spec, param in params]
            scatter_full(buffers, lambda name, key=key: by_name[name][key])  # type: ignore[misc]
            for (_, param), (_, buffer) in zip(params, buffers, strict=True):
                optimizer.state[param][key] = buffer
        for _, param in params:
            optimizer.state[param]["step"] = torch.tensor(step, dtype=torch.float32)
    scheduler.load_state_dict(state["scheduler"])
