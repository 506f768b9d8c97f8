"""gRPC layer of weight-sync (miles.weightsync.v1.WeightSyncService): parse, call the core, translate.

Errors are MilesErrors raised by the core and mapped to gRPC statuses by miles.common's interceptor, which also
checks the bearer token (settings.auth_token) of every WeightSyncService call; health and reflection stay open.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from miles.common.auth import BearerAuth
from miles.common.contracts.engine_control import PAUSE_MODES
from miles.common.errors import InvalidArgumentError, MilesError
from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.proto.weightsync.v1 import weightsync_pb2 as pb
from miles.proto.weightsync.v1 import weightsync_pb2_grpc as pb_grpc
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.engines import EngineOutcome
from miles.weightsync.errors import InvalidPublishError, PublishChannelUnavailableError, UnsupportedTransportError
from miles.weightsync.events import ENGINE_UPDATE_FAILED, ENGINE_UPDATED, ROLLOUT_COMPLETE, STORED, VersionEvent
from miles.weightsync.manifest import Manifest
from miles.weightsync.publish import PublishedVersion
from miles.weightsync.rollout import PAUSE_TO_PB, TRANSPORT_TO_PB, RolloutPlan
from miles.weightsync.wire import (
    TensorChecks,
    encoded_weights_chunks,
    header_message,
    meta_from_pb,
    serialize_weights_message,
    spec_from_pb,
)

SERVICE_NAME = "miles.weightsync.v1.WeightSyncService"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
_TRANSPORT_FROM_PB = {value: key for key, value in TRANSPORT_TO_PB.items()}
_PAUSE_FROM_PB = {value: key for key, value in PAUSE_TO_PB.items()}
_EVENT_KIND = {
    STORED: pb.VERSION_EVENT_KIND_STORED,
    ENGINE_UPDATED: pb.VERSION_EVENT_KIND_ENGINE_UPDATED,
    ENGINE_UPDATE_FAILED: pb.VERSION_EVENT_KIND_ENGINE_UPDATE_FAILED,
    ROLLOUT_COMPLETE: pb.VERSION_EVENT_KIND_ROLLOUT_COMPLETE,
}


def outcome_to_pb(outcome: EngineOutcome) -> pb.EngineVersion:
    return pb.EngineVersion(
        engine_url=outcome.engine_url,
        weight_version=outcome.weight_version,
        update_failed=outcome.update_failed,
        error=outcome.error,
        fell_back=outcome.fell_back,
        update_duration_s=outcome.update_duration_s,
        daemon=outcome.daemon,
        pause_s=outcome.pause_s,
        transfer_s=outcome.transfer_s,
        wire_bytes=outcome.wire_bytes,
        step_to_serving_s=outcome.step_to_serving_s,
    )


def publish_response(manifest: Manifest, *, already_stored: bool) -> pb.PublishWeightsResponse:
    return pb.PublishWeightsResponse(
        version=common_pb2.WeightVersion(
            job_id=manifest.job_id,
            version=manifest.version,
            parent_version=manifest.parent_version,
            manifest_sha256=manifest.manifest_sha256,
            created_at_unix_ms=manifest.created_at_unix_ms,
        ),
        full_bytes=manifest.full_bytes,
        stored_bytes=manifest.stored_bytes,
        is_snapshot=manifest.is_snapshot,
        num_changed_elements=0 if manifest.is_snapshot and manifest.parent_version < 0 else manifest.num_changed,
        num_elements=manifest.num_elements,
        already_stored=already_stored,
        weights_digest=manifest.weights_digest,
    )


def event_to_pb(event: VersionEvent) -> pb.VersionEvent:
    return pb.VersionEvent(
        kind=_EVENT_KIND[event.kind],
        version=event.version,
        engine_url=event.engine_url,
        error=event.error,
        at_unix_ms=event.at_unix_ms,
        full_bytes=event.full_bytes,
        stored_bytes=event.stored_bytes,
        fell_back=event.fell_back,
        pause_s=event.pause_s,
        transfer_s=event.transfer_s,
        wire_bytes=event.wire_bytes,
        step_to_serving_s=event.step_to_serving_s,
        weights_digest=event.weights_digest,
    )


class WeightSyncServicer(pb_grpc.WeightSyncServiceServicer):
    def __init__(self, core: WeightSyncCore) -> None:
        self.core = core

    async def PublishWeights(
        self, request_iterator: AsyncIterator[pb.PublishWeightsChunk], context: grpc.aio.ServicerContext
    ) -> pb.PublishWeightsResponse:
        metrics = self.core.metrics
        try:
            start_s = time.perf_counter()
            try:
                received = await self._receive(request_iterator)
            except MilesError:
                await self._discard_rest(request_iterator)
                raise
            if isinstance(received, Manifest):  # this exact version is stored already: the rest carries nothing new
                await self._discard_rest(request_iterator)
                self.core.intake.republished(received)
                return publish_response(received, already_stored=True)
            metrics.observe_phase("receive", time.perf_counter() - start_s)
            metrics.published_bytes.labels("grpc").inc(sum(spec.num_bytes for spec in received.specs))
            manifest, already_stored = await self.core.intake.store_or_twin(received)
        except MilesError:
            metrics.publishes.labels("rejected").inc()
            raise
        return publish_response(manifest, already_stored=already_stored)

    async def _receive(self, request_iterator: AsyncIterator[pb.PublishWeightsChunk]) -> PublishedVersion | Manifest:
        checks: TensorChecks | None = None
        async for message in request_iterator:
            kind = message.WhichOneof("payload")
            if checks is None:
                if kind != "header":
                    raise InvalidPublishError("the first message must be the header", field="header")
                header = message.header
                specs = [spec_from_pb(t) for t in header.tensors]
                begun = await self.core.intake.begin_publish(meta_from_pb(header), specs)
                if isinstance(begun, Manifest):
                    return begun
                checks = TensorChecks(begun)
            elif kind == "chunk":
                checks.add_chunk(message.chunk.tensor_index, message.chunk.offset, message.chunk.data)
            elif kind == "commit":
                return await checks.commit(message.commit.manifest_sha256)
            else:
                raise InvalidPublishError(f"unexpected {kind} after the header", field="payload")
        raise InvalidPublishError("the stream ended before the commit (truncated)", field="commit")

    async def _discard_rest(self, request_iterator: AsyncIterator[pb.PublishWeightsChunk]) -> None:
        """Read what the client still sends before answering with the error: grpcio's asyncio client reports
        INTERNAL instead of the server's status when the call ends while it is still writing (grpc/grpc#36066).
        Bounded by max_publish_bytes (a legitimate publish never sends more)."""
        num_bytes = 0
        async for message in request_iterator:
            num_bytes += message.ByteSize()
            if num_bytes > self.core.settings.max_publish_bytes:
                return

    async def GetVersion(
        self, request: pb.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetVersionResponse:
        self.core.check_job(request.job_id)
        status = await self.core.status()
        return pb.GetVersionResponse(
            latest_version=status.latest_version,
            engines=[outcome_to_pb(outcome) for outcome in status.engines],
            stored_versions=status.stored_versions,
            superseded=[
                pb.SupersededVersions(
                    first_version=r.first_version, last_version=r.last_version, by_version=r.by_version
                )
                for r in status.superseded
            ],
            latest_weights_digest=status.latest_weights_digest,
        )

    async def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.VersionEvent]:
        self.core.check_job(request.job_id)
        async for event in self.core.watch(request.from_version):
            yield event_to_pb(event)

    async def UpdateEngines(
        self, request: pb.UpdateEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateEnginesResponse:
        self.core.check_job(request.job_id)
        outcomes = await self.core.update_engines(self._plan(request))
        return pb.UpdateEnginesResponse(
            engines=[outcome_to_pb(outcome) for outcome in outcomes],
            num_fallbacks=sum(outcome.fell_back for outcome in outcomes),
            num_failed=sum(outcome.update_failed for outcome in outcomes),
        )

    def _plan(self, request: pb.UpdateEnginesRequest) -> RolloutPlan:
        settings = self.core.settings
        transport = _TRANSPORT_FROM_PB.get(request.transport, settings.transport)
        if transport == "nccl":
            raise UnsupportedTransportError(
                "nccl is driven from the trainer (miles.weightsync.nccl)", field="transport"
            )
        pause_mode = _PAUSE_FROM_PB.get(request.pause_mode, settings.pause_mode)
        assert pause_mode in PAUSE_MODES
        if request.max_engines_updating < 0:
            raise InvalidArgumentError("max_engines_updating must be >= 1 (0 = default)", field="max_engines_updating")
        if request.engine_timeout_s < 0:
            raise InvalidArgumentError("engine_timeout_s must be > 0 (0 = default)", field="engine_timeout_s")
        return RolloutPlan(
            version=request.version,
            transport=transport,
            pause_mode=pause_mode,
            max_engines_updating=request.max_engines_updating or settings.max_engines_updating,
            engine_timeout_s=request.engine_timeout_s or settings.engine_timeout_s,
            engine_urls=tuple(request.engine_urls),
            step_finished_unix_ms=request.step_finished_unix_ms,
        )

    async def FetchWeights(
        self, request: pb.FetchWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PublishWeightsChunk | bytes]:
        self.core.check_job(request.job_id)
        num_shards = max(1, request.num_shards)
        if not 0 <= request.shard_index < num_shards:
            raise InvalidArgumentError("shard_index must be in [0, num_shards)", field="shard_index")
        weights = await self.core.full_weights(request.version)
        chunk_bytes = request.chunk_bytes or self.core.settings.chunk_bytes
        served = self.core.metrics.served_bytes.labels("fetch_weights")
        for message in encoded_weights_chunks(
            self.core.job_id,
            weights.version,
            request.version - 1,
            weights.specs,
            weights.data,
            chunk_bytes,
            shard_index=request.shard_index,
            num_shards=num_shards,
        ):
            if isinstance(message, bytes):
                served.inc(len(message))
            yield message

    async def OpenDataChannel(
        self, request: pb.OpenDataChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenDataChannelResponse:
        self.core.check_job(request.job_id)
        offer = await self.core.open_data_channel(request.version, max(1, request.num_connections))
        weights = offer.weights
        return pb.OpenDataChannelResponse(
            host=self.core.settings.data_host,
            port=offer.port,
            token=offer.token,
            num_connections=offer.num_connections,
            header=header_message(self.core.job_id, weights.version, weights.version - 1, weights.specs).header,
            manifest_sha256=weights.manifest_sha256,
            expires_in_s=offer.timeout_s,
        )

    async def OpenPublishChannel(
        self, request: pb.OpenPublishChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenPublishChannelResponse:
        header = request.header
        specs = [spec_from_pb(t) for t in header.tensors]
        try:
            opened = await self.core.intake.open_publish_channel(
                meta_from_pb(header), specs, max(1, request.num_connections)
            )
        except PublishChannelUnavailableError:
            raise  # the trainer falls back to PublishWeights: not a rejected publish
        except MilesError:
            self.core.metrics.publishes.labels("rejected").inc()
            raise
        if isinstance(opened, Manifest):  # this exact version is stored already: nothing is to be sent
            self.core.intake.republished(opened)
            return pb.OpenPublishChannelResponse(stored=publish_response(opened, already_stored=True))
        return pb.OpenPublishChannelResponse(
            host=self.core.settings.data_host,
            port=opened.port,
            token=opened.token,
            num_connections=opened.num_connections,
            expires_in_s=opened.timeout_s,
            publish_id=opened.publish_id,
        )

    async def CommitPublish(
        self, request: pb.CommitPublishRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitPublishResponse:
        try:
            self.core.check_job(request.job_id)
            manifest, already_stored = await self.core.intake.commit_publish(
                request.publish_id, request.manifest_sha256
            )
        except MilesError:
            self.core.metrics.publishes.labels("rejected").inc()
            raise
        return pb.CommitPublishResponse(stored=publish_response(manifest, already_stored=already_stored))

    async def FetchStoredVersion(
        self, request: pb.FetchStoredVersionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StoredVersionChunk]:
        self.core.check_job(request.job_id)
        manifest, blob_sha256s = await self.core.stored_blobs(request.version)
        yield pb.StoredVersionChunk(manifest_json=manifest.to_json())
        chunk_bytes = request.chunk_bytes or self.core.settings.chunk_bytes
        for sha256 in blob_sha256s:
            data = await self.core.read_blob(sha256)
            for offset in range(0, max(1, len(data)), chunk_bytes):
                piece = data[offset : offset + chunk_bytes]
                self.core.metrics.served_bytes.labels("fetch_stored").inc(len(piece))
                yield pb.StoredVersionChunk(
                    blob=pb.BlobChunk(sha256=sha256, total_bytes=len(data), offset=offset, data=piece)
                )


def add_servicer(servicer: WeightSyncServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated add_WeightSyncServiceServicer_to_server, except that
    FetchWeights takes pre-encoded chunk bytes (wire.encode_chunk) as well as messages."""
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "PublishWeights": grpc.stream_unary_rpc_method_handler(
            servicer.PublishWeights,
            request_deserializer=pb.PublishWeightsChunk.FromString,
            response_serializer=pb.PublishWeightsResponse.SerializeToString,
        ),
        "GetVersion": grpc.unary_unary_rpc_method_handler(
            servicer.GetVersion,
            request_deserializer=pb.GetVersionRequest.FromString,
            response_serializer=pb.GetVersionResponse.SerializeToString,
        ),
        "WatchVersions": grpc.unary_stream_rpc_method_handler(
            servicer.WatchVersions,
            request_deserializer=pb.WatchVersionsRequest.FromString,
            response_serializer=pb.VersionEvent.SerializeToString,
        ),
        "UpdateEngines": grpc.unary_unary_rpc_method_handler(
            servicer.UpdateEngines,
            request_deserializer=pb.UpdateEnginesRequest.FromString,
            response_serializer=pb.UpdateEnginesResponse.SerializeToString,
        ),
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            servicer.FetchWeights,
            request_deserializer=pb.FetchWeightsRequest.FromString,
            response_serializer=serialize_weights_message,
        ),
        "OpenDataChannel": grpc.unary_unary_rpc_method_handler(
            servicer.OpenDataChannel,
            request_deserializer=pb.OpenDataChannelRequest.FromString,
            response_serializer=pb.OpenDataChannelResponse.SerializeToString,
        ),
        "OpenPublishChannel": grpc.unary_unary_rpc_method_handler(
            servicer.OpenPublishChannel,
            request_deserializer=pb.OpenPublishChannelRequest.FromString,
            response_serializer=pb.OpenPublishChannelResponse.SerializeToString,
        ),
        "CommitPublish": grpc.unary_unary_rpc_method_handler(
            servicer.CommitPublish,
            request_deserializer=pb.CommitPublishRequest.FromString,
            response_serializer=pb.CommitPublishResponse.SerializeToString,
        ),
        "FetchStoredVersion": grpc.unary_stream_rpc_method_handler(
            servicer.FetchStoredVersion,
            request_deserializer=pb.FetchStoredVersionRequest.FromString,
            response_serializer=pb.StoredVersionChunk.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def build_server(core: WeightSyncCore, metrics: Metrics, *, port: int) -> GrpcServer:
    """The daemon's gRPC server on settings.host:`port` (0: a free port); with settings.auth_token every
    WeightSyncService method needs that bearer token (UNAUTHENTICATED without one, PERMISSION_DENIED with another)."""
    settings = core.settings
    return build_grpc_server(
        servicers=[(add_servicer, WeightSyncServicer(core))],
        service_names=[SERVICE_NAME],
        metrics=metrics,
        host=settings.host,
        port=port,
        max_message_bytes=MAX_MESSAGE_BYTES,
        auth=BearerAuth([settings.auth_token.get_secret_value()], what="weight-sync's WeightSyncService"),
    )
