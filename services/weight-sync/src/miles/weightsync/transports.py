"""How a stored version reaches one engine: the transports behind one interface, chosen by `make_transport`.

A load has two halves. `prepare` does everything that does not touch the engine — fetch the version from the origin
or the store, decode and verify it against its checksums, encode the engine's request bodies — while the engine
keeps serving; `apply` sends it to the engine, which the caller has quiesced (drained or paused) meanwhile, so the
engine pauses only for the swap. Both get what this daemon knows the engine holds (`current`, None when unknown);
`apply` returns what the engine holds afterwards. The final load call carries weight_version=v; the caller then
sets the version label, checks it and resumes.

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
import dataclasses
import logging
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from miles.common.errors import NotFoundError
from miles.weightsync.engine_client import EngineClient
from miles.weightsync.errors import StoreCorruptError, UnsupportedTransportError
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.metrics import WeightsyncMetrics
from miles.weightsync.provider import WeightProvider, counting_received
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


@dataclass(frozen=True)
class PreparedLoad:
    """A version made ready next to an engine before it is quiesced: fetched, decoded, verified and encoded into
    the engine's request bodies, so that the engine pauses only for `apply` (the swap).

    `payloads` are /update_weights_from_tensor bodies (base64 safetensors, one batch each), `model_path` the
    checkpoint directory of the disk transport; `received_bytes` is what crossed the network to prepare it."""

    version: int
    weights: WeightSet | None
    mode: str
    payloads: tuple[str, ...] = ()
    num_tensor_bytes: int = 0
    model_path: str = ""
    received_bytes: int = 0
    stage_id: str = ""
    """Set when the payloads were staged in the engine already (apply then only swaps them in)."""


class WeightTransport(abc.ABC):
    name: ClassVar[str]

    async def prepare(self, engine_url: str, version: int, current: WeightSet | None) -> PreparedLoad:
        """Everything of a load that does not touch the engine (it keeps serving meanwhile); by default nothing."""
        return PreparedLoad(version, None, "full")

    async def stage(self, engine: EngineClient, prepared: PreparedLoad) -> PreparedLoad:
        """Hand the engine what it can take before it is quiesced (it keeps serving); by default nothing."""
        return prepared

    @abc.abstractmethod
    async def apply(self, engine: EngineClient, prepared: PreparedLoad) -> LoadResult:
        """Load the prepared version into the quiesced `engine`; raises a MilesError when it cannot."""

    async def load(self, engine: EngineClient, version: int, current: WeightSet | None) -> LoadResult:
        """prepare + apply (for callers that quiesce around both)."""
        return await self.apply(engine, await self.prepare(engine.base_url, version, current))


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


async def tensor_payloads(weights: WeightSet, specs: Sequence[TensorSpec], batch_bytes: int) -> tuple[str, ...]:
    """/update_weights_from_tensor bodies for `specs` of `weights`, batches of at most batch_bytes raw bytes."""
    return tuple(
        [await asyncio.to_thread(_base64_safetensors, batch, weights) for batch in tensor_batches(specs, batch_bytes)]
    )


async def send_payloads(engine: EngineClient, payloads: Sequence[str], version: int) -> None:
    """POST the prepared batches; the last one sets the version. No batch (nothing changed): only the label."""
    for index, payload in enumerate(payloads):
        label = str(version) if index == len(payloads) - 1 else None
        await engine.update_weights_from_tensor([payload], label)


async def send_tensors(
    engine: EngineClient, weights: WeightSet, specs: Sequence[TensorSpec], batch_bytes: int, version: int
) -> int:
    """POST `specs` of `weights` to /update_weights_from_tensor in batches; the last batch sets the version."""
    await send_payloads(engine, await tensor_payloads(weights, specs, batch_bytes), version)
    return sum(spec.num_bytes for spec in specs)


class _TensorTransport(WeightTransport):
    """Transports that end in /update_weights_from_tensor with payloads prepared in advance."""

    def __init__(self, provider: WeightProvider, batch_bytes: int) -> None:
        self.provider = provider
        self.batch_bytes = batch_bytes

    async def _prepared(
        self, weights: WeightSet, specs: Sequence[TensorSpec], mode: str, received_bytes: int
    ) -> PreparedLoad:
        payloads = await tensor_payloads(weights, specs, self.batch_bytes)
        num_bytes = sum(spec.num_bytes for spec in specs)
        return PreparedLoad(weights.version, weights, mode, payloads, num_bytes, received_bytes=received_bytes)

    async def stage(self, engine: EngineClient, prepared: PreparedLoad) -> PreparedLoad:
        """Stage the payloads in the engine while it serves (engines with /stage_weights_from_tensor); unchanged
        when it has none or there is nothing to send."""
        if not prepared.payloads:
            return prepared
        stage_id = f"v{prepared.version}-{uuid.uuid4().hex[:12]}"
        for payload in prepared.payloads:
            if not await engine.stage_weights_from_tensor([payload], stage_id):
                return prepared
        return dataclasses.replace(prepared, stage_id=stage_id)

    async def apply(self, engine: EngineClient, prepared: PreparedLoad) -> LoadResult:
        if prepared.stage_id:
            await engine.apply_staged_weights(prepared.stage_id, str(prepared.version))
        else:
            await send_payloads(engine, prepared.payloads, prepared.version)
        return LoadResult(prepared.weights, prepared.mode, prepared.num_tensor_bytes)


class DiskTransport(WeightTransport):
    name = "disk"

    def __init__(self, provider: WeightProvider, work_dir: Path, model_config_dir: Path) -> None:
        self.provider = provider
        self.work_dir = work_dir
        self.config_files = [model_config_dir / name for name in _CONFIG_FILES if (model_config_dir / name).is_file()]
        if not any(path.name == "config.json" for path in self.config_files):
            raise UnsupportedTransportError(f"no config.json in model_config_dir {str(model_config_dir)!r}")

    def _engine_dir(self, engine_url: str) -> Path:
        return self.work_dir / re.sub(r"[^A-Za-z0-9]+", "_", engine_url).strip("_")

    async def prepare(self, engine_url: str, version: int, current: WeightSet | None) -> PreparedLoad:
        with counting_received() as received:
            weights = await self.provider.full(version)
        target = self._engine_dir(engine_url) / f"v{version:012d}"
        await asyncio.to_thread(self._write_checkpoint, target, weights)
        return PreparedLoad(
            version,
            weights,
            "full",
            num_tensor_bytes=weights.full_bytes,
            model_path=str(target),
            received_bytes=received.num_bytes,
        )

    async def apply(self, engine: EngineClient, prepared: PreparedLoad) -> LoadResult:
        await engine.update_weights_from_disk(prepared.model_path, str(prepared.version))
        await asyncio.to_thread(self._remove_others, self._engine_dir(engine.base_url), Path(prepared.model_path))
        return LoadResult(prepared.weights, "full", prepared.num_tensor_bytes)

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


class DeltaTransport(_TensorTransport):
    name = "delta"

    def __init__(self, provider: WeightProvider, metrics: WeightsyncMetrics, batch_bytes: int) -> None:
        super().__init__(provider, batch_bytes)
        self.metrics = metrics

    async def prepare(self, engine_url: str, version: int, current: WeightSet | None) -> PreparedLoad:
        with counting_received() as received:
            if current is None or current.version > version:
                weights = await self.provider.full(version)
                return await self._prepared(weights, weights.specs, "full", received.num_bytes)
            try:
                weights = await self.provider.advance(current, version)
            except (StoreCorruptError, NotFoundError) as exc:  # NotFound: retention removed a version in between
                reason = "missing" if isinstance(exc, NotFoundError) else "verification"
                self.metrics.fallbacks.labels(reason).inc()
                log.warning(
                    "delta unusable, falling back to a full load",
                    extra={"engine_url": engine_url, "weight_version": version, "error": exc.message},
                )
                weights = await self.provider.full(version)
                return await self._prepared(weights, weights.specs, "fallback", received.num_bytes)
        return await self._prepared(weights, weights.changed_since(current), "delta", received.num_bytes)


class StreamTransport(_TensorTransport):
    name = "stream"

    async def prepare(self, engine_url: str, version: int, current: WeightSet | None) -> PreparedLoad:
        with counting_received() as received:
            weights = await self.provider.stream_full(version)
        return await self._prepared(weights, weights.specs, "full", received.num_bytes)


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
