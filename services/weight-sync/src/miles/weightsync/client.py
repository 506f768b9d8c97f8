"""Client of weight-sync for the trainer (and tools): publish torch tensors as a new version, roll a version
out, query and watch versions, fetch a version's tensors.

`publish` converts each tensor to the engine dtype (default bfloat16) on the CPU and hashes it, then sends the
header (names, dtypes, shapes, sha256 of every tensor) and the tensors. By default the bytes go over the origin's
raw TCP data channel (`OpenPublishChannel`, `data_connections` connections each `sendall`ing its tensors straight
from their memory, publish_sender.py, then `CommitPublish`): Python gRPC moves well under half of what a socket
moves. It falls back to the PublishWeights stream (chunks, then the commit) when no channel can be set up — a
daemon that predates it (UNIMPLEMENTED), one with the data channel off (FAILED_PRECONDITION that is not a refused
publish), a listener that refuses or cannot be reached, a token refused before the ACK; a failed setup makes the
next publishes of this client use the stream for DATA_CHANNEL_RETRY_S. A transfer that breaks after the ACK is
an error, not a fallback. The header needs every checksum first, so tensors are converted twice (once to hash,
once to send) unless they fit in `max_cached_bytes`; memory stays near one tensor (per data connection) for big
models. Typical use from the trainer:

    async with WeightSyncClient("127.0.0.1:50053", auth_token=weightsync_auth_token) as client:
        result = await client.publish(job_id, version=step, parent_version=step - 1,
                                      named_tensors=model.named_parameters())
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from miles.common.faults import crash_point
from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.daemon_client import DATA_CHANNEL_RETRY_S, SERVICE_NAME, address_host, fetch_weights
from miles.weightsync.errors import DataChannelError, DataChannelSetupError
from miles.weightsync.manifest import TensorSpec, manifest_digest
from miles.weightsync.publish import PublishedVersion
from miles.weightsync.publish_sender import PublishSender
from miles.weightsync.rollout import PAUSE_TO_PB, TRANSPORT_TO_PB
from miles.weightsync.wire import spec_to_pb

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]
_PUBLISH_REFUSALS = ("WrongParentError", "VersionTakenError")  # FAILED_PRECONDITION that a fallback would repeat
_DEFAULT_DATA_TIMEOUT_S = 60.0  # the longest stall of a data connection when an offer does not say


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
    already_stored: bool
    """The store held this exact version already (a retried or repeated publish): nothing was written."""
    weights_digest: str
    """miles.common.weights.weights_digest of the version, as the origin computed it."""
    path: str = "grpc"
    """How the tensors went: "data_channel", "grpc" (PublishWeights) or "already_stored" (nothing was sent)."""

    @property
    def delta_ratio(self) -> float:
        """Stored bytes / full bytes (1-ish for a snapshot)."""
        return self.stored_bytes / self.full_bytes if self.full_bytes else 0.0


def result_from_pb(response: pb.PublishWeightsResponse, path: str = "grpc") -> PublishResult:
    return PublishResult(
        version=response.version.version,
        parent_version=response.version.parent_version,
        manifest_sha256=response.version.manifest_sha256,
        full_bytes=response.full_bytes,
        stored_bytes=response.stored_bytes,
        is_snapshot=response.is_snapshot,
        num_changed_elements=response.num_changed_elements,
        num_elements=response.num_elements,
        already_stored=response.already_stored,
        weights_digest=response.weights_digest,
        path=path,
    )


def _use_publish_weights(exc: grpc.aio.AioRpcError) -> bool:
    """Whether OpenPublishChannel's error means "publish with PublishWeights": a daemon that predates it, or one
    without a data channel; a refused publish (wrong parent, version taken) is not retried that way."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return True
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    error = error_from_rpc_error(exc)
    refused = error.details.get("server_error_type") in _PUBLISH_REFUSALS or (error.field or "").startswith("header")
    return not refused


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> np.ndarray:
    """The tensor's raw bytes (uint8 array) after conversion to `dtype` on the CPU, contiguous."""
    import torch

    converted = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
    if converted.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return converted.reshape(-1).view(torch.uint8).numpy()


class _Converter:
    """Converts tensors on demand, keeping converted bytes while they fit in the budget. Sending half of the
    tensors passes the crash point `weightsync.client.publish.mid_transfer` (key: the version) for fault tests."""

    def __init__(
        self, pairs: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None, budget_bytes: int, version: int
    ) -> None:
        self.pairs = pairs
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.version = version
        self._cache: dict[int, np.ndarray] = {}
        self._num_sent = 0

    def raw(self, index: int) -> np.ndarray:
        self._num_sent += 1
        if self._num_sent == max(1, len(self.pairs) // 2):
            crash_point("weightsync.client.publish.mid_transfer", self.version)
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
    def __init__(
        self,
        target: str,
        *,
        chunk_bytes: int = 1 << 20,
        max_cached_bytes: int = 1 << 30,
        data_channel: bool = True,
        data_connections: int = 4,
        auth_token: str = "",
    ) -> None:
        """`data_channel`: publish over the origin's raw TCP data channel when it offers one (else PublishWeights
        only), over `data_connections` connections (the daemon may grant fewer). `auth_token`: the daemon's
        auth_token, sent with every call ("" = the daemon is open; a wrong one fails calls with
        PermissionDeniedError, none where one is needed with UnauthenticatedError)."""
        if data_connections < 1:
            raise ValueError("data_connections must be >= 1")
        self.target = target
        self.chunk_bytes = chunk_bytes
        self.max_cached_bytes = max_cached_bytes
        self.data_channel = data_channel
        self.data_connections = data_connections
        self._data_channel_retry_at = 0.0  # time.monotonic() before which publishes use PublishWeights
        self._channel = create_channel(target, service_names=[SERVICE_NAME], bearer_token=auth_token)
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
        step_finished_unix_ms: int = 0,
        restored_from_version: int | None = None,
    ) -> PublishResult:
        """Publish `named_tensors` (converted to `dtype`; None keeps each tensor's) as `version`.

        `step_finished_unix_ms`: when the optimizer step that produced them finished (for step-to-serving
        latency). `restored_from_version`: a restarted trainer publishing its checkpoint of that version under a
        new number (the versions in between are superseded; see PublishHeader)."""
        import torch

        engine_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        converter = _Converter(list(items), engine_dtype, self.max_cached_bytes, version)
        specs = [await asyncio.to_thread(converter.spec, i) for i in range(len(converter.pairs))]
        header = pb.PublishHeader(
            job_id=job_id,
            version=version,
            parent_version=parent_version,
            tensors=[spec_to_pb(s) for s in specs],
            step_finished_unix_ms=step_finished_unix_ms,
            restored_from_version=restored_from_version,
        )
        if self.data_channel and time.monotonic() >= self._data_channel_retry_at:
            result = await self._publish_over_data_channel(header, specs, converter)
            if result is not None:
                return result
        try:
            response = await self._stub.PublishWeights(self._publish_messages(header, specs, converter))
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc_error(exc) from exc
        return result_from_pb(response, "grpc")

    async def _publish_over_data_channel(
        self, header: pb.PublishHeader, specs: Sequence[TensorSpec], converter: _Converter
    ) -> PublishResult | None:
        """The publish over a data channel; None when none can be set up (publish with PublishWeights)."""
        request = pb.OpenPublishChannelRequest(header=header, num_connections=self.data_connections)
        try:
            offer: pb.OpenPublishChannelResponse = await self._stub.OpenPublishChannel(request)
        except grpc.aio.AioRpcError as exc:
            if not _use_publish_weights(exc):
                raise error_from_rpc_error(exc) from exc
            log.info("no publish data channel offered, using PublishWeights", extra={"error": exc.details()})
            return None
        if offer.HasField("stored"):
            return result_from_pb(offer.stored, "already_stored")
        host = offer.host or address_host(self.target)
        timeout_s = offer.expires_in_s if offer.expires_in_s > 0 else _DEFAULT_DATA_TIMEOUT_S
        sender = PublishSender(host, offer.port, offer.token, specs, max(1, offer.num_connections), timeout_s)
        try:
            await asyncio.to_thread(sender.connect)
        except DataChannelSetupError as exc:
            log.warning(
                "publish data channel failed to set up, using PublishWeights",
                extra={"error": exc.message, "retry_in_s": DATA_CHANNEL_RETRY_S},
            )
            self._data_channel_retry_at = time.monotonic() + DATA_CHANNEL_RETRY_S
            return None
        failure: DataChannelError | None = None
        try:
            await asyncio.to_thread(sender.send, lambda index: converter.raw(index).data)
        except asyncio.CancelledError:
            sender.abort()
            raise
        except DataChannelError as exc:
            failure = exc  # CommitPublish says why (the daemon's view), or stores it if every byte arrived
        digest = manifest_digest([spec.sha256 for spec in specs])
        commit = pb.CommitPublishRequest(job_id=header.job_id, publish_id=offer.publish_id, manifest_sha256=digest)
        try:
            response: pb.CommitPublishResponse = await self._stub.CommitPublish(commit)
        except grpc.aio.AioRpcError as exc:
            error = error_from_rpc_error(exc)
            if failure is not None:
                raise DataChannelError(f"{failure.message}; the daemon: {error.message}", field=error.field) from exc
            raise error from exc
        return result_from_pb(response.stored, "data_channel")

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
    target: str,
    job_id: str,
    version: int,
    parent_version: int,
    named_tensors: NamedTensors,
    *,
    auth_token: str = "",
    **kwargs: Any,
) -> PublishResult:
    """One-shot `WeightSyncClient(target, auth_token=auth_token).publish(...)`."""
    async with WeightSyncClient(target, auth_token=auth_token) as client:
        return await client.publish(job_id, version, parent_version, named_tensors, **kwargs)
