"""gRPC client of another weight-sync daemon of the same job: the origin (versions and full weights) or a peer
(its engines, and updating one of them). Failed calls raise the MilesError the other daemon raised."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import grpc

from miles.common.errors import MilesError
from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.errors import StoreCorruptError
from miles.weightsync.publish import PublishedVersion
from miles.weightsync.wire import receive_weights

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
    """One channel to a daemon at `address` ("host:port")."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = create_channel(address, service_names=[SERVICE_NAME])
        self.stub = pb_grpc.WeightSyncServiceStub(self._channel)  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self._channel.close()

    async def fetch_weights(self, job_id: str, version: int, *, num_streams: int, chunk_bytes: int) -> PublishedVersion:
        """A version's full tensors over `num_streams` concurrent streams, every checksum verified."""
        return await fetch_weights(self._channel, job_id, version, num_streams=num_streams, chunk_bytes=chunk_bytes)

    def fetch_stored(self, job_id: str, version: int, chunk_bytes: int) -> AsyncIterator[pb.StoredVersionChunk]:
        request = pb.FetchStoredVersionRequest(job_id=job_id, version=version, chunk_bytes=chunk_bytes)
        return _reraise(self.stub.FetchStoredVersion(request))

    async def get_version(self, job_id: str) -> pb.GetVersionResponse:
        try:
            response: pb.GetVersionResponse = await self.stub.GetVersion(pb.GetVersionRequest(job_id=job_id))
        except grpc.aio.AioRpcError as exc:
            raise mapped_error(exc) from exc
        return response

    async def update_engines(self, request: pb.UpdateEnginesRequest) -> pb.UpdateEnginesResponse:
        try:
            response: pb.UpdateEnginesResponse = await self.stub.UpdateEngines(request)
        except grpc.aio.AioRpcError as exc:
            raise mapped_error(exc) from exc
        return response


async def close_all(clients: Sequence[DaemonClient]) -> None:
    for client in clients:
        await client.close()
