"""Pieces both backends share: where each response token's logprob comes from in a packed forward, the
optimizer and scheduler, and full (gathered) state dicts through torch.distributed.checkpoint's helpers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from miles.common.jobspec.trainer import OptimizerConfig
from miles.trainer.backends.base import lr_multiplier
from miles.trainer.batch import TrainSample


@dataclass(frozen=True)
class PackedRows:
    """For a packed forward of `samples` (concatenated in order): `rows[k]` is the row whose output predicts
    response token k (its position minus one) and `targets[k]` that token's id; k runs over every response
    token of every sample in order."""

    token_ids: list[torch.Tensor]
    rows: torch.Tensor
    targets: torch.Tensor


def is_routed(sample: TrainSample) -> bool:
    """Whether the sample carries routing for at least one position (a 1-token sample has none to carry)."""
    return sample.routed_experts is not None and sample.num_tokens > 1


def packed_rows(samples: Sequence[TrainSample], *, trim_routed: bool = False) -> PackedRows:
    """With `trim_routed`, a sample carrying routing (`is_routed`) is fed without its last token: no logprob
    depends on that position, and its recorded routing covers exactly the positions fed (0..T-2)."""
    token_ids: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    offset = 0
    for sample in samples:
        ids = torch.tensor(sample.tokens, dtype=torch.long)
        token_ids.append(ids[:-1] if trim_routed and is_routed(sample) else ids)
        num_tokens = ids.shape[0]
        # A sample whose response starts at 0 has no row for its first token: it is scored from row 0 (its mask
        # is 0, batch.py refuses a trainable one), so shapes stay aligned.
        first = max(sample.response_start, 1)
        extra = first - sample.response_start
        rows.append(
            torch.cat([torch.full((extra,), offset), torch.arange(offset + first - 1, offset + num_tokens - 1)])
        )
        targets.append(ids[sample.response_start :])
        offset += token_ids[-1].shape[0]
    return PackedRows(
        token_ids=token_ids,
        rows=torch.cat(rows).long() if rows else torch.zeros(0, dtype=torch.long),
        targets=torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long),
    )


def build_optimizer(
    parameters: Iterable[nn.Parameter],
    config: OptimizerConfig,
    num_steps: int,
    *,
    own_lr: Sequence[tuple[Sequence[nn.Parameter], float]] = (),
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (foreach off: identical numerics on DTensors and plain tensors) and its schedule. `own_lr`: parameters
    (among `parameters`) with a peak learning rate of their own (a value head), each set its own parameter group
    after the main one; the schedule scales every group alike."""
    separate = {id(p) for params, _ in own_lr for p in params}
    groups: list[dict[str, Any]] = [{"params": [p for p in parameters if p.requires_grad and id(p) not in separate]}]
    groups += [{"params": list(params), "lr": lr} for params, lr in own_lr]
    optimizer = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config, num_steps))
    return optimizer, scheduler


def full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (gathered in full under FSDP, on the CPU) plus the scheduler."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "scheduler": scheduler.state_dict(),
    }


def load_full_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    *,
    distributed: bool,
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    scheduler.load_state_dict(state["scheduler"])


def global_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None) -> float:
    """Clip (when max_norm is set) and return the total norm before clipping; works on DTensor gradients."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full)
