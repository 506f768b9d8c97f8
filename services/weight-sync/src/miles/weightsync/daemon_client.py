"""gRPC client of another weight-sync daemon of the same job: the origin (versions and full weights) or a peer
(its engines, and updating one of them). Failed calls raise the MilesError the other daemon raised.

Full weights come over a raw TCP data channel negotiated with OpenDataChannel (datachannel.py, receive.py) when
asked to, else — and whenever the channel cannot be set up — over FetchWeights streams.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import grpc

from miles.common.errors import MilesError
from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.errors import DataChannelSetupError, StoreCorruptError
from miles.weightsync.publish import PublishedVersion
from miles.weightsync.receive import DataChannelReceiver, receive_over_data_channel
from miles.weightsync.wire import receive_weights, spec_from_pb

log = logging.getLogger(__name__)
SERVICE_NAME = "miles.weightsync.v1.WeightSyncService"
T = TypeVar("T")


def mapped_error(exc: grpc.aio.AioRpcError) -> MilesError:
    """The MilesError the other daemon raised; DATA_LOSS (a corrupt stored blob) stays a StoreCorruptError."""
    if exc.code() == grpc.StatusCode.DATA_LOSS:
        return StoreCorruptError(f"the other daemon's store is corrupt: {exc.details()}")
    return error_from_rpc_error(exc)


async def _reraise(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        async for message in stream:
            yield message
    except grpc.aio.AioRpcError as exc:
        raise mapped_error(exc) from exc


FETCH_WEIGHTS_METHOD = f"/{SERVICE_NAME}/FetchWeights"
_NO_DATA_CHANNEL = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)
DATA_CHANNEL_RETRY_S = 300.0  # after a failed setup, full loads use FetchWeights this long before trying again


def address_host(address: str) -> str:
    """The host part of a gRPC target "host:port" ("[v6]:port", optionally with a dns:/// or ipv4: scheme)."""
    target = address.split("///", 1)[-1]
    if target.startswith(("ipv4:", "ipv6:")):
        target = target[5:]
    return target.rsplit(":", 1)[0].strip("[]")


async def fetch_weights(
    channel: grpc.aio.Channel, job_id: str, version: int, *, num_streams: int, chunk_bytes: int
) -> PublishedVersion:
    """FetchWeights over `num_streams` concurrent shard streams, chunks decoded without protobuf copies."""
    call = channel.unary_stream(
        FETCH_WEIGHTS_METHOD,
        request_serializer=pb.FetchWeightsRequest.SerializeToString,
        response_deserializer=None,  # raw bytes: wire.decode_chunk takes the chunks, protobuf the rest
    )
    streams = [
        _reraise(
            call(
                pb.FetchWeightsRequest(
                    job_id=job_id, version=version, chunk_bytes=chunk_bytes, num_shards=num_streams, shard_index=i
                )
            )
        )
        for i in range(num_streams)
    ]
    return await receive_weights(streams)


class DaemonClient:
    """One channel to a daemon at `address` ("host:port"); every call carries `auth_token` (the job's weight-sync
    token, shared by its daemons; "" = they are open)."""

    def __init__(self, address: str, *, auth_token: str = "") -> None:
        self.address = address
        self._channel = create_channel(address, service_names=[SERVICE_NAME], bearer_token=auth_token)
        self.stub = pb_grpc.WeightSyncServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._data_channel_retry_at = 0.0  # time.monotonic() before which the data channel is not tried

    async def close(self) -> None:
        await self._channel.close()

    async def fetch_weights(self, job_id: str, version: int, *, num_streams: int, chunk_bytes: int) -> PublishedVersion:
        """A version's full tensors over `num_streams` concurrent streams, every checksum verified."""
        return await fetch_weights(self._channel, job_id, version, num_streams=num_streams, chunk_bytes=chunk_bytes)

    async def fetch_full(
        self, job_id: str, version: int, *, num_connections: int, chunk_bytes: int, data_timeout_s: float | None
    ) -> tuple[PublishedVersion, str]:
        """A version's full tensors, every checksum verified, and the path they took: "data_channel", "grpc"
        (data_timeout_s None = not asked for, or the daemon does not offer one) or "fallback" (it could not be
        set up now, or did not DATA_CHANNEL_RETRY_S ago). A transfer that breaks after setup raises
        (DataChannelError) instead of falling back."""
        path = "grpc"
        if data_timeout_s is not None and time.monotonic() < self._data_channel_retry_at:
            path = "fallback"
        elif data_timeout_s is not None:
            request = pb.OpenDataChannelRequest(job_id=job_id, version=version, num_connections=num_connections)
            try:
                offer: pb.OpenDataChannelResponse = await self.stub.OpenDataChannel(request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _NO_DATA_CHANNEL:
                    raise mapped_error(exc) from exc
                log.info("no data channel offered, using FetchWeights", extra={"error": exc.details()})
            else:
                specs = [spec_from_pb(spec) for spec in offer.header.tensors]
                host = offer.host or address_host(self.address)
                receiver = DataChannelReceiver(
                    host, offer.port, offer.token, specs, max(1, offer.num_connections), data_timeout_s
                )
                try:
                    received = await receive_over_data_channel(
                        receiver, job_id=job_id, version=offer.header.version, manifest_sha256=offer.manifest_sha256
                    )
                except DataChannelSetupError as exc:
                    log.warning(
                        "data channel failed to set up, using FetchWeights",
                        extra={"error": exc.message, "retry_in_s": DATA_CHANNEL_RETRY_S},
                    )
                    self._data_channel_retry_at = time.monotonic() + DATA_CHANNEL_RETRY_S
                    path = "fallback"
                else:
                    if received.version != version:
                        raise StoreCorruptError(f"asked for version {version}, the origin offered {received.version}")
                    return received, "data_channel"
        fetched = await self.fetch_weights(job_id, version, num_streams=num_connections, chunk_bytes=chunk_bytes)
        return fetched, path

    def fetch_stored(self, job_id: str, version: int, chunk_bytes: int) -> AsyncIterator[pb.StoredVersionChunk]:
        request = pb.FetchStoredVersionRequest(job_id=job_id, version=version, chunk_bytes=chunk_bytes)
        return _reraise(self.stub.FetchStoredVersion(request))

    async def get_version(self, job_id: str, *, timeout_s: float | None = None) -> pb.GetVersionResponse:
        """`timeout_s`: the call's deadline (None = none); past it the call raises (DEADLINE_EXCEEDED)."""
        try:
            response: pb.GetVersionResponse = await self.stub.GetVersion(
                pb.GetVersionRequest(job_id=job_id), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise mapped_error(exc) from exc
        return response

    async def update_engines(
        self, request: pb.UpdateEnginesRequest, *, timeout_s: float | None = None
    ) -> pb.UpdateEnginesResponse:
        """`timeout_s`: the call's deadline (None = none); past it the call raises (DEADLINE_EXCEEDED)."""
        try:
            response: pb.UpdateEnginesResponse = await self.stub.UpdateEngines(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise mapped_error(exc) from exc
        return response


async def close_all(clients: Sequence[DaemonClient]) -> None:
    for client in clients:
        await client.close()
