"""Client of weight-sync for the trainer (and tools): publish torch tensors as a new version, roll a version
out, query and watch versions, fetch a version's tensors.

`publish` converts each tensor to the engine dtype (default bfloat16) on the CPU and streams it as
PublishWeights chunks: one header (names, dtypes, shapes, sha256 of every tensor), the chunks, one commit. The
header needs every checksum first, so tensors are converted twice (once to hash, once to send) unless they fit
in `max_cached_bytes`; memory stays near one tensor for big models. Typical use from the trainer:

    async with WeightSyncClient("127.0.0.1:50053") as client:
        result = await client.publish(job_id, version=step, parent_version=step - 1,
                                      named_tensors=model.named_parameters())
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.daemon_client import SERVICE_NAME, fetch_weights
from miles.weightsync.manifest import TensorSpec, manifest_digest
from miles.weightsync.publish import PublishedVersion
from miles.weightsync.rollout import PAUSE_TO_PB, TRANSPORT_TO_PB
from miles.weightsync.wire import spec_to_pb

if TYPE_CHECKING:
    import torch

NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class PublishResult:
    version: int
    parent_version: int
    manifest_sha256: str
    full_bytes: int
    stored_bytes: int
    is_snapshot: bool
    num_changed_elements: int
    num_elements: int

    @property
    def delta_ratio(self) -> float:
        """Stored bytes / full bytes (1-ish for a snapshot)."""
        return self.stored_bytes / self.full_bytes if self.full_bytes else 0.0


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> np.ndarray:
    """The tensor's raw bytes (uint8 array) after conversion to `dtype` on the CPU, contiguous."""
    import torch

    converted = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
    if converted.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return converted.reshape(-1).view(torch.uint8).numpy()


class _Converter:
    """Converts tensors on demand, keeping converted bytes while they fit in the budget."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, budget_bytes: int) -> None:
        self.pairs = pairs
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self._cache: dict[int, np.ndarray] = {}

    def raw(self, index: int) -> np.ndarray:
        cached = self._cache.pop(index, None)
        return cached if cached is not None else tensor_bytes(self.pairs[index][1], self.dtype)

    def spec(self, index: int) -> TensorSpec:
        name, tensor = self.pairs[index]
        raw = tensor_bytes(tensor, self.dtype)
        if raw.nbytes <= self.budget_bytes:
            self._cache[index] = raw
            self.budget_bytes -= raw.nbytes
        dtype = str(self.dtype or tensor.dtype).removeprefix("torch.")
        return TensorSpec(name, dtype, tuple(int(d) for d in tensor.shape), hashlib.sha256(raw.data).hexdigest())


class WeightSyncClient:
    def __init__(self, target: str, *, chunk_bytes: int = 1 << 20, max_cached_bytes: int = 1 << 30) -> None:
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.max_cached_bytes = max_cached_bytes
        self._channel = create_channel(target, service_names=[SERVICE_NAME])
        self._stub = pb_grpc.WeightSyncServiceStub(self._channel)  # type: ignore[no-untyped-call]

    async def __aenter__(self) -> WeightSyncClient:
        return self

    async def __aexit__(self, *exc_info: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def publish(
        self,
        job_id: str,
        version: int,
        parent_version: int,
        named_tensors: NamedTensors,
        *,
        dtype: torch.dtype | str | None = "bfloat16",
    ) -> PublishResult:
        """Publish `named_tensors` (converted to `dtype`; None keeps each tensor's) as `version`."""
        import torch

        engine_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        converter = _Converter(list(items), engine_dtype, self.max_cached_bytes)
        specs = [await asyncio.to_thread(converter.spec, i) for i in range(len(converter.pairs))]
        header = pb.PublishHeader(
            job_id=job_id, version=version, parent_version=parent_version, tensors=[spec_to_pb(s) for s in specs]
        )
        try:
            response = await self._stub.PublishWeights(self._publish_messages(header, specs, converter))
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc
        return PublishResult(
            version=response.version.version,
            parent_version=response.version.parent_version,
            manifest_sha256=response.version.manifest_sha256,
            full_bytes=response.full_bytes,
            stored_bytes=response.stored_bytes,
            is_snapshot=response.is_snapshot,
            num_changed_elements=response.num_changed_elements,
            num_elements=response.num_elements,
        )

    async def _publish_messages(
        self, header: pb.PublishHeader, specs: Sequence[TensorSpec], converter: _Converter
    ) -> AsyncIterator[pb.PublishWeightsChunk]:
        yield pb.PublishWeightsChunk(header=header)
        for index in range(len(specs)):
            raw = await asyncio.to_thread(converter.raw, index)
            for offset in range(0, raw.nbytes, self.chunk_bytes):
                data = raw[offset : offset + self.chunk_bytes].tobytes()
                yield pb.PublishWeightsChunk(chunk=pb.TensorChunk(tensor_index=index, offset=offset, data=data))
        digest = manifest_digest([spec.sha256 for spec in specs])
        yield pb.PublishWeightsChunk(commit=pb.PublishCommit(manifest_sha256=digest))

    async def get_version(self, job_id: str) -> pb.GetVersionResponse:
        response: pb.GetVersionResponse = await self._unary(self._stub.GetVersion, pb.GetVersionRequest(job_id=job_id))
        return response

    async def update_engines(
        self,
        job_id: str,
        version: int,
        *,
        transport: str = "",
        pause_mode: str = "",
        max_engines_updating: int = 0,
        engine_timeout_s: float = 0.0,
        engine_urls: Sequence[str] = (),
    ) -> pb.UpdateEnginesResponse:
        """Roll `version` out (transport/pause_mode "" = the daemon's defaults) and wait for every engine."""
        request = pb.UpdateEnginesRequest(
            job_id=job_id,
            version=version,
            transport=TRANSPORT_TO_PB.get(transport, pb.TRANSPORT_UNSPECIFIED),
            pause_mode=PAUSE_TO_PB.get(pause_mode, pb.PAUSE_MODE_UNSPECIFIED),
            max_engines_updating=max_engines_updating,
            engine_timeout_s=engine_timeout_s,
            engine_urls=list(engine_urls),
        )
        response: pb.UpdateEnginesResponse = await self._unary(self._stub.UpdateEngines, request)
        return response

    async def watch_versions(self, job_id: str, from_version: int = 0) -> AsyncIterator[pb.VersionEvent]:
        call = self._stub.WatchVersions(pb.WatchVersionsRequest(job_id=job_id, from_version=from_version))
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc
        finally:
            call.cancel()

    async def fetch_weights(self, job_id: str, version: int, *, num_streams: int = 1) -> PublishedVersion:
        """A version's full tensors (raw bytes by name), every checksum verified."""
        return await fetch_weights(
            self._channel, job_id, version, num_streams=num_streams, chunk_bytes=self.chunk_bytes
        )

    @staticmethod
    async def _unary(method: Any, request: Any) -> Any:
        try:
            return await method(request)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc


async def publish(
    target: str, job_id: str, version: int, parent_version: int, named_tensors: NamedTensors, **kwargs: Any
) -> PublishResult:
    """One-shot `WeightSyncClient(target).publish(...)`."""
    async with WeightSyncClient(target) as client:
        return await client.publish(job_id, version, parent_version, named_tensors, **kwargs)
