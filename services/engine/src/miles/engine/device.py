"""Where the torch runner computes: `EngineSettings.device` resolved and checked at start-up, and the library
state deterministic mode needs on a GPU.

`resolve_device` turns `cpu`, `cuda` or `cuda:N` into a concrete `torch.device` (`cuda` = the current CUDA device,
with its index, so that every tensor the runner creates names the same GPU) and raises `ConfigError` when the GPU
cannot be used, so the engine fails at start-up instead of at its first request.

Deterministic mode on CUDA (`configure_cuda_determinism`): the shape-invariant kernels of `miles.model.kernels`
already run every matrix product on fixed 32-row blocks; on a GPU two more things must hold, and are set here,
process-wide, before the first cuBLAS call:
- `CUBLAS_WORKSPACE_CONFIG` (only if unset): cuBLAS is reproducible only with a fixed workspace per stream, and
  torch refuses deterministic mode without it. `:4096:8` is torch's own default on Hopper (H100/H200), so an
  engine and a trainer that leaves it unset pick the same GEMM algorithms there.
- `torch.use_deterministic_algorithms(True, warn_only=True)`: ops with a deterministic variant use it (the
  cumulative sums of sampling, index_put); ops without one warn instead of failing, so a path not covered by the
  GPU checks is visible in the log rather than a crash.

Limits: both settings are process-wide (an in-process trainer shares them); bit equality with a trainer holds only
on the same GPU model with the same torch/CUDA build; a CPU trainer matches a CUDA engine within a tolerance.
"""

from __future__ import annotations

import logging
import os

import torch

from miles.common.errors import ConfigError

log = logging.getLogger(__name__)
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""What the engine sets when the variable is unset: 8 buffers of 4 MiB per stream (torch's default on sm90)."""


def resolve_device(name: str) -> torch.device:
    """The concrete device of a `device` setting; ConfigError when it names a GPU torch cannot use."""
    if name == "cpu":
        return torch.device("cpu")
    if not name.startswith("cuda"):
        raise ConfigError(f"device {name!r} is not cpu, cuda or cuda:N", field="device")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {name!r} needs CUDA, but torch.cuda.is_available() is false (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}): run on a GPU node with a CUDA torch, or use device 'cpu'",
            field="device",
        )
    num_gpus = torch.cuda.device_count()
    index = int(name.partition(":")[2]) if ":" in name else torch.cuda.current_device()
    if index >= num_gpus:
        raise ConfigError(f"device {name!r}: only {num_gpus} CUDA device(s) are visible", field="device")
    return torch.device("cuda", index)


def configure_cuda_determinism() -> dict[str, str]:
    """Set what deterministic mode needs on a GPU (see the module doc); returns what was set, for the log."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=True)
    applied = {
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "use_deterministic_algorithms": "true (warn_only)",
    }
    log.info("deterministic mode on CUDA: process-wide torch settings applied", extra=applied)
    return applied
