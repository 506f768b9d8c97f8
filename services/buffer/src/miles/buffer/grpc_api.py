"""gRPC transport of the buffer (miles.buffer.v1.BufferService): parse, call the core, build the response.

Errors are raised as MilesError subclasses and mapped to gRPC status by miles.common's interceptor. Waits
(full job, long poll) end a little before the call's deadline so that the caller gets RESOURCE_EXHAUSTED or a
(possibly empty) batch instead of DEADLINE_EXCEEDED.

`add_buffer_service` registers the servicer like the generated `add_BufferServiceServicer_to_server`, with two
differences on the hot path: PushGroup also receives the raw request bytes (the group is stored as received),
and PullBatch returns prebuilt response bytes (stored groups are spliced in unparsed). The wire contract is
unchanged: clients see ordinary protobuf messages.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from opentelemetry import trace

from miles.buffer.convert import (
    PUSH_OUTCOME_TO_PROTO,
    config_from_proto,
    config_to_proto,
    pull_response_bytes,
    stats_to_proto,
)
from miles.buffer.core import Buffer
from miles.buffer.errors import InvalidRequestError
from miles.buffer.wire import top_level_len_field
from miles.proto.buffer.v1 import buffer_pb2

SERVICE_NAME = "miles.buffer.v1.BufferService"
CONTROL_METHODS = frozenset({f"/{SERVICE_NAME}/ConfigureJob", f"/{SERVICE_NAME}/DeleteJob"})
"""The RPCs that need the operator token (settings.operator_token); the rest is the jobs' data plane."""
_PUSH_GROUP_FIELD = buffer_pb2.PushGroupRequest.DESCRIPTOR.fields_by_name["group"].number


@dataclass(frozen=True)
class PushGroupCall:
    """A parsed PushGroupRequest plus the serialized group exactly as it arrived."""

    request: buffer_pb2.PushGroupRequest
    group_bytes: bytes

    @classmethod
    def from_bytes(cls, data: bytes) -> PushGroupCall:
        return cls(buffer_pb2.PushGroupRequest.FromString(data), top_level_len_field(data, _PUSH_GROUP_FIELD))


def _wait_within_deadline(wait_s: float, context: grpc.aio.ServicerContext) -> float:
    """wait_s, shortened so the call answers before its deadline (a tenth of what is left, at most 0.5 s)."""
    remaining_s: float | None = context.time_remaining()
    if remaining_s is None:
        return wait_s
    return max(0.0, min(wait_s, remaining_s - min(0.5, 0.1 * remaining_s)))


def _tag_span(job_id: str, trainer_version: int | None = None) -> None:
    """Puts the job (and the puller's weight version) on the RPC's server span."""
    span = trace.get_current_span()
    span.set_attribute("miles.job_id", job_id)
    if trainer_version is not None:
        span.set_attribute("miles.weight_version", trainer_version)


class BufferServicer:
    """The BufferService methods; register with `add_buffer_service`."""

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer

    async def ConfigureJob(
        self, request: buffer_pb2.ConfigureJobRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.ConfigureJobResponse:
        _tag_span(request.job_id)
        config = await self.buffer.configure_job(request.job_id, config_from_proto(request.config))
        return buffer_pb2.ConfigureJobResponse(config=config_to_proto(config))

    async def DeleteJob(
        self, request: buffer_pb2.DeleteJobRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.DeleteJobResponse:
        _tag_span(request.job_id)
        return buffer_pb2.DeleteJobResponse(num_groups_deleted=await self.buffer.delete_job(request.job_id))

    async def PushGroup(self, call: PushGroupCall, context: grpc.aio.ServicerContext) -> buffer_pb2.PushGroupResponse:
        request = call.request
        _tag_span(request.job_id)
        if not (request.wait_s >= 0 and math.isfinite(request.wait_s)):
            raise InvalidRequestError(f"wait_s must be a finite number >= 0, got {request.wait_s}", field="wait_s")
        wait_s = _wait_within_deadline(min(request.wait_s or math.inf, self.buffer.settings.push_wait_max_s), context)
        result = await self.buffer.push_group(
            request.job_id, request.group, wait_s=wait_s, group_bytes=call.group_bytes
        )
        return buffer_pb2.PushGroupResponse(
            outcome=PUSH_OUTCOME_TO_PROTO[result.outcome], num_queued_groups=result.num_queued_groups
        )

    async def PullBatch(self, request: buffer_pb2.PullBatchRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Returns the serialized PullBatchResponse (see module docstring)."""
        _tag_span(request.job_id, request.trainer_version)
        wait_s = _wait_within_deadline(request.wait_s, context) if request.wait_s >= 0 else request.wait_s
        result = await self.buffer.pull_batch(
            request.job_id,
            num_groups=request.num_groups,
            trainer_version=request.trainer_version,
            max_staleness=request.max_staleness,
            lease_s=request.lease_s,
            wait_s=wait_s,
            min_groups=request.min_groups,
            consumer_id=request.consumer_id,
        )
        return pull_response_bytes(result)

    async def Ack(self, request: buffer_pb2.AckRequest, context: grpc.aio.ServicerContext) -> buffer_pb2.AckResponse:
        _tag_span(request.job_id)
        result = await self.buffer.ack(request.job_id, list(request.lease_ids))
        return buffer_pb2.AckResponse(
            num_acked=result.num_acked,
            num_already_acked=result.num_already_acked,
            expired_lease_ids=result.expired_lease_ids,
        )

    async def Nack(self, request: buffer_pb2.NackRequest, context: grpc.aio.ServicerContext) -> buffer_pb2.NackResponse:
        _tag_span(request.job_id)
        num_returned = await self.buffer.nack(
            request.job_id,
            list(request.lease_ids),
            discard=request.discard,
            consumer_id=request.consumer_id,
            reason=request.reason,
        )
        return buffer_pb2.NackResponse(num_returned=num_returned)

    async def ExtendLease(
        self, request: buffer_pb2.ExtendLeaseRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.ExtendLeaseResponse:
        _tag_span(request.job_id)
        result = await self.buffer.extend_lease(request.job_id, list(request.lease_ids), request.lease_s)
        return buffer_pb2.ExtendLeaseResponse(
            num_extended=result.num_extended,
            expired_lease_ids=result.expired_lease_ids,
            lease_expires_unix_ms=result.lease_expires_unix_ms,
        )

    async def PullRequeued(
        self, request: buffer_pb2.PullRequeuedRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.PullRequeuedResponse:
        _tag_span(request.job_id)
        prompts = await self.buffer.pull_requeued(request.job_id, request.max_prompts)
        return buffer_pb2.PullRequeuedResponse(
            prompts=[
                buffer_pb2.RequeuedPrompt(group_id=p.group_id, prompt_index=p.prompt_index, epoch=p.epoch)
                for p in prompts
            ]
        )

    async def Stats(
        self, request: buffer_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> buffer_pb2.StatsResponse:
        _tag_span(request.job_id)
        return stats_to_proto(await self.buffer.stats(request.job_id))


def _pass_through(data: bytes) -> bytes:
    return data


@dataclass(frozen=True)
class UndecodableRequest:
    """What the deserializer hands on for bytes that are not the method's request message."""

    reason: str


def _decoding(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: gRPC would answer UNKNOWN for an exception there."""

    def decode(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, ValueError, IndexError) as error:
            return UndecodableRequest(f"{type(error).__name__}: {error}")

    return decode


def _refusing_undecodable(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Answers INVALID_ARGUMENT (through the error interceptor) when the request bytes did not decode."""

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, UndecodableRequest):
            raise InvalidRequestError(f"the request is not a valid protobuf message ({request.reason})")
        return await behavior(request, context)

    return call


def add_buffer_service(servicer: BufferServicer, server: grpc.aio.Server) -> None:
    """Registers every method of BufferService (taken from the proto descriptor, so none can be missed)."""
    handlers: dict[str, Any] = {}
    for method in buffer_pb2.DESCRIPTOR.services_by_name["BufferService"].methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        parse = PushGroupCall.from_bytes if method.name == "PushGroup" else request_class.FromString
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable(getattr(servicer, method.name)),
            request_deserializer=_decoding(parse),
            response_serializer=_pass_through if method.name == "PullBatch" else response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
