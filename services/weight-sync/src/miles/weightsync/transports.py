"""How a stored version reaches one engine: the transports behind one interface, chosen by `make_transport`.

Every transport loads version v into an engine that the caller has quiesced (drained or paused), given what
this daemon knows the engine holds (`current`, None when unknown), and returns what the engine holds afterwards.
The final load call carries weight_version=v; the caller then sets the version label, checks it and resumes.

- `disk`   full weights (head cache, origin stream or store) -> an HF checkpoint directory next to the engine
           (model.safetensors + the job's config.json) -> /update_weights_from_disk. Works with stock SGLang.
- `delta`  `current` + the stored deltas up to v, every decoded tensor checked against its sha256 *before* any
           byte is sent; only the tensors that changed go to /update_weights_from_tensor. Any verification or
           store failure falls back to a full load (counted); no local copy yet means a full load.
- `stream` full weights from the origin daemon over a one-shot raw TCP data channel negotiated over gRPC
           (OpenDataChannel, `fetch_streams` connections; datachannel.py), else over FetchWeights streams, every
           tensor checked, then /update_weights_from_tensor.
- `nccl`   SGLang's /init_weights_update_group + /update_weights_from_distributed, driven from the trainer
           process that holds the tensors (nccl.py); a daemon cannot run it.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import logging
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from miles.common.errors import NotFoundError
from miles.weightsync.engine_client import EngineClient
from miles.weightsync.errors import StoreCorruptError, UnsupportedTransportError
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.provider import WeightProvider
from miles.weightsync.safetensors_io import encode_safetensors, write_safetensors_file
from miles.weightsync.weights import WeightSet

log = logging.getLogger(__name__)
TRANSPORT_NAMES = ("disk", "delta", "stream", "nccl")
_CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class LoadResult:
    """What an engine holds after a load (None: not known to this process) and how it got there."""

    weights: WeightSet | None
    mode: str  # "delta", "full" or "fallback"
    bytes_to_engine: int


class WeightTransport(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    async def load(self, engine: EngineClient, version: int, current: WeightSet | None) -> LoadResult:
        """Load `version` into the quiesced `engine`; raises a MilesError when it cannot."""


def tensor_batches(specs: Sequence[TensorSpec], batch_bytes: int) -> list[list[TensorSpec]]:
    """Specs split into consecutive batches of at most batch_bytes raw bytes (a bigger tensor goes alone)."""
    batches: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    filled = 0
    for spec in specs:
        if current and filled + spec.num_bytes > batch_bytes:
            batches.append(current)
            current, filled = [], 0
        current.append(spec)
        filled += spec.num_bytes
    if current:
        batches.append(current)
    return batches


def _base64_safetensors(specs: Sequence[TensorSpec], weights: WeightSet) -> str:
    return base64.b64encode(encode_safetensors(specs, weights.data)).decode("ascii")


async def send_tensors(
    engine: EngineClient, weights: WeightSet, specs: Sequence[TensorSpec], batch_bytes: int, version: int
) -> int:
    """POST `specs` of `weights` to /update_weights_from_tensor in batches; the last batch sets the version."""
    batches = tensor_batches(specs, batch_bytes)
    for index, batch in enumerate(batches):
        payload = await asyncio.to_thread(_base64_safetensors, batch, weights)
        label = str(version) if index == len(batches) - 1 else None
        await engine.update_weights_from_tensor([payload], label)
    return sum(spec.num_bytes for spec in specs)


class DiskTransport(WeightTransport):
    name = "disk"

    def __init__(self, provider: WeightProvider, work_dir: Path, model_config_dir: Path) -> None:
        self.provider = provider
        self.work_dir = work_dir
        self.config_files = [model_config_dir / name for name in _CONFIG_FILES if (model_config_dir / name).is_file()]
        if not any(path.name == "config.json" for path in self.config_files):
            raise UnsupportedTransportError(f"no config.json in model_config_dir {str(model_config_dir)!r}")

    async def load(self, engine: EngineClient, version: int, current: WeightSet | None) -> LoadResult:
        weights = await self.provider.full(version)
        engine_dir = self.work_dir / re.sub(r"[^A-Za-z0-9]+", "_", engine.base_url).strip("_")
        target = engine_dir / f"v{version:012d}"
        await asyncio.to_thread(self._write_checkpoint, target, weights)
        await engine.update_weights_from_disk(str(target), str(version))
        await asyncio.to_thread(self._remove_others, engine_dir, target)
        return LoadResult(weights, "full", weights.full_bytes)

    def _write_checkpoint(self, target: Path, weights: WeightSet) -> None:
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for path in self.config_files:
            shutil.copyfile(path, partial / path.name)
        write_safetensors_file(partial / "model.safetensors", weights.specs, weights.data)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)

    @staticmethod
    def _remove_others(engine_dir: Path, keep: Path) -> None:
        for path in engine_dir.iterdir():
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)


class DeltaTransport(WeightTransport):
    name = "delta"

    def __init__(self, provider: WeightProvider, metrics: WeightsyncMetrics, batch_bytes: int) -> None:
        self.provider = provider
        self.metrics = metrics
        self.batch_bytes = batch_bytes

    async def load(self, engine: EngineClient, version: int, current: WeightSet | None) -> LoadResult:
        if current is None or current.version > version:
            weights = await self.provider.full(version)
            sent = await send_tensors(engine, weights, weights.specs, self.batch_bytes, version)
            return LoadResult(weights, "full", sent)
        try:
            weights = await self.provider.advance(current, version)
        except (StoreCorruptError, NotFoundError) as exc:  # NotFound: retention removed a version in between
            reason = "missing" if isinstance(exc, NotFoundError) else "verification"
            self.metrics.fallbacks.labels(reason).inc()
            log.warning(
                "delta unusable, falling back to a full load",
                extra={"engine_url": engine.base_url, "weight_version": version, "error": exc.message},
            )
            weights = await self.provider.full(version)
            sent = await send_tensors(engine, weights, weights.specs, self.batch_bytes, version)
            return LoadResult(weights, "fallback", sent)
        sent = await send_tensors(engine, weights, weights.changed_since(current), self.batch_bytes, version)
        return LoadResult(weights, "delta", sent)


class StreamTransport(WeightTransport):
    name = "stream"

    def __init__(self, provider: WeightProvider, batch_bytes: int) -> None:
        self.provider = provider
        self.batch_bytes = batch_bytes

    async def load(self, engine: EngineClient, version: int, current: WeightSet | None) -> LoadResult:
        weights = await self.provider.stream_full(version)
        sent = await send_tensors(engine, weights, weights.specs, self.batch_bytes, version)
        return LoadResult(weights, "full", sent)


@dataclass(frozen=True)
class TransportDeps:
    """What the transports may need; each takes only its own part. `nccl_weights(version)` gives the trainer's
    tensors (torch, engine dtype) for the nccl transport."""

    provider: WeightProvider | None = None
    metrics: WeightsyncMetrics | None = None
    work_dir: Path | None = None
    model_config_dir: Path | None = None
    tensor_batch_bytes: int = 256 << 20
    nccl_config: Any = None
    nccl_weights: Callable[[int], Mapping[str, Any]] | None = None


def make_transport(name: str, deps: TransportDeps) -> WeightTransport:
    """The transport called `name` (disk, delta, stream, nccl) built from `deps`."""
    if name == "nccl":
        if deps.nccl_config is None or deps.nccl_weights is None:
            raise UnsupportedTransportError("the nccl transport runs in the trainer process (miles.weightsync.nccl)")
        from miles.weightsync.nccl import NcclTransport  # torch is imported only on this path

        return NcclTransport(deps.nccl_config, deps.nccl_weights)
    if name not in TRANSPORT_NAMES:
        raise UnsupportedTransportError(f"unknown transport {name!r}; one of {list(TRANSPORT_NAMES)}")
    if deps.provider is None or deps.metrics is None:
        raise UnsupportedTransportError(f"the {name} transport needs the daemon's weight provider")
    if name == "disk":
        if deps.work_dir is None or deps.model_config_dir is None:
            raise UnsupportedTransportError("the disk transport needs work_dir and model_config_dir")
        return DiskTransport(deps.provider, deps.work_dir, deps.model_config_dir)
    if name == "delta":
        return DeltaTransport(deps.provider, deps.metrics, deps.tensor_batch_bytes)
    return StreamTransport(deps.provider, deps.tensor_batch_bytes)
