"""gRPC aio channel helpers: trace-context propagation, retry policy and mapping errors back to MilesError.

`create_channel(target)` returns a channel whose calls carry the current trace context in metadata and retry
UNAVAILABLE with exponential backoff (gRPC's own retry policy: safe only because it never retries a call that
already got a response). `error_from_rpc_error` turns a failed call back into the MilesError subclass the
server raised, keeping its field and retry hint, so that client libraries raise typed errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import grpc

from miles.common.auth import bearer_metadata
from miles.common.errors import MilesError, error_class_for_grpc_status
from miles.common.telemetry import inject_context

_DEFAULT_RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def _with_metadata(
    details: grpc.aio.ClientCallDetails, extra: tuple[tuple[str, str], ...]
) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    inject_context(carrier)
    if not carrier and not extra:
        return details
    metadata = list(details.metadata or ()) + list(carrier.items()) + list(extra)
    return details._replace(metadata=grpc.aio.Metadata(*metadata))


class _MetadataInterceptor:
    def __init__(self, extra: tuple[tuple[str, str], ...]) -> None:
        self.extra = extra


class _TraceUnaryUnary(_MetadataInterceptor, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request)


class _TraceUnaryStream(_MetadataInterceptor, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request)


class _TraceStreamUnary(_MetadataInterceptor, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request_iterator)


class _TraceStreamStream(_MetadataInterceptor, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_metadata(details, self.extra), request_iterator)


def create_channel(
    target: str,
    *,
    service_names: Sequence[str] = (),
    max_message_bytes: int = 256 * 1024 * 1024,
    retry_unavailable: bool = True,
    bearer_token: str = "",
) -> grpc.aio.Channel:
    """An insecure aio channel to `target` ("host:port") with tracing and, for `service_names`, retries; every call
    carries `bearer_token` (when set) as `authorization` metadata (miles.common.auth).

    In-cluster traffic is plain gRPC; a service mesh or NetworkPolicies protect it (see the chart).
    """
    extra = bearer_metadata(bearer_token)
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if retry_unavailable and service_names:
        service_config = {
            "methodConfig": [
                {"name": [{"service": name} for name in service_names], "retryPolicy": _DEFAULT_RETRY_POLICY}
            ]
        }
        options += [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(service_config))]
    return grpc.aio.insecure_channel(
        target,
        options=options,
        interceptors=[
            interceptor(extra)
            for interceptor in (_TraceUnaryUnary, _TraceUnaryStream, _TraceStreamUnary, _TraceStreamStream)
        ],
    )


def error_from_rpc_error(error: grpc.aio.AioRpcError) -> MilesError:
    """The MilesError a failed call stands for: the standard class for its status, with field and retry hint.

    A call that failed CANCELLED because its task is being cancelled raises CancelledError instead: grpc can turn a
    task's cancellation into that status, and a caller's retry loop would then swallow the stop."""
    task = asyncio.current_task()
    if error.code() == grpc.StatusCode.CANCELLED and task is not None and task.cancelling():
        raise asyncio.CancelledError(error.details() or "cancelled")
    trailing = {key: value for key, value in (error.trailing_metadata() or ()) if isinstance(value, str)}
    error_class = error_class_for_grpc_status(error.code())
    retry_after = trailing.get("retry-after-s")
    mapped = error_class(
        error.details() or error.code().name,
        field=trailing.get("miles-error-field"),
        retry_after_s=float(retry_after) if retry_after else None,
        details={"grpc_status": error.code().name, "server_error_type": trailing.get("miles-error-type", "")},
    )
    return mapped
