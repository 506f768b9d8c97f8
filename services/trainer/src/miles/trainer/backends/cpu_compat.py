"""What megatron-core 0.16.1 needs to run on a machine without CUDA; applied only when CUDA is absent.

Megatron assumes a GPU in places a CPU forward/backward reaches (found with torch's CPU build):
- `torch.cuda.current_device()` is called for device arguments (rotary embeddings, the attention buffers, the
  pipeline's receive buffers): on the CPU it is made to return "cpu";
- the model-parallel RNG tracker (`tensor_parallel.get_cuda_rng_tracker().fork()`) saves and restores CUDA RNG
  states: a tracker that keeps named CPU generator states is installed instead;
- the pipeline schedules (PP > 1): point-to-point shape exchange calls `torch.cuda.synchronize()` (made a no-op:
  gloo's operations are complete when waited on) and the 1F1B schedule allocates its token counter with
  `device="cuda"` (its module sees a torch whose `zeros` maps "cuda" to the CPU).
Megatron's optimizer factory and activation recomputation also assume CUDA: the backend uses torch.optim and
refuses gradient checkpointing on the CPU. Process-wide patches, idempotent; never applied when CUDA exists.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

_applied = False


class CpuRngStatesTracker:
    """Named CPU RNG states with the interface of Megatron's CudaRNGStatesTracker."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        previous = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(previous)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        previous = torch.get_rng_state()
        if name in self.states_:
            torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            if name in self.states_:
                self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(previous)


def apply_cpu_compat() -> bool:
    """Install the CPU stand-ins when CUDA is not available; returns whether they are in force."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.pipeline_parallel import schedules  # type: ignore[import-untyped]
    from megatron.core.tensor_parallel import random as megatron_random  # type: ignore[import-untyped]

    cuda: Any = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device=None: None
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRngStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    schedules.torch = _CpuDeviceTorch()
    _applied = True
    return True


class _CpuDeviceTorch(types.ModuleType):
    """`torch` as megatron's schedules module sees it on the CPU: the same module but for `zeros`, whose
    device="cuda" (the schedule's token counter) becomes the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*size, **kwargs)
