"""gRPC aio server helpers: health service, reflection, error/tracing/metrics interceptor, graceful shutdown.

`build_grpc_server` returns a `GrpcServer` with the standard `grpc.health.v1.Health` service (every registered
service SERVING once started, NOT_SERVING while shutting down) and server reflection. One interceptor wraps
every RPC handler so that:
- a span is started as a child of the caller's trace context (W3C `traceparent` in metadata),
- a raised `MilesError` becomes its gRPC status with the message, plus trailing metadata
  `miles-error-type`, `miles-error-field` and `retry-after-s` for clients to map it back,
- request counts and latency are recorded (`miles_<service>_grpc_requests_total{method,code}`, ...),
- with `auth` (a `miles.common.auth.BearerAuth`), every call but health and reflection (or, with `auth_methods`,
  only those full method names) needs its bearer token in metadata (UNAUTHENTICATED without one,
  PERMISSION_DENIED with another) before the handler runs.
Limit: streaming-response handlers must be async generators (the `yield` style), not `context.write` style.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from miles.common.auth import BearerAuth
from miles.common.errors import MilesError
from miles.common.telemetry import Metrics, extract_context

AddServicerFn = Callable[[Any, grpc.aio.Server], None]


def _error_metadata(error: MilesError) -> tuple[tuple[str, str], ...]:
    metadata = [("miles-error-type", type(error).__name__)]
    if error.field is not None:
        metadata.append(("miles-error-field", error.field))
    if error.retry_after_s is not None:
        metadata.append(("retry-after-s", f"{error.retry_after_s:g}"))
    return tuple(metadata)


class _ServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, metrics: Metrics, auth: BearerAuth | None, auth_methods: Collection[str] | None) -> None:
        self.auth = auth
        self.auth_methods = None if auth_methods is None else frozenset(auth_methods)
        self.tracer = trace.get_tracer("miles.common.grpc")
        self.requests_total = metrics.counter(
            "grpc_requests", "gRPC calls answered, by full method name and status code", ["method", "code"]
        )
        self.request_duration_s = metrics.histogram(
            "grpc_request_duration_seconds", "Time to the end of the gRPC call, seconds", ["method"]
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return handler
        method = details.method
        carrier = {key: value for key, value in (details.invocation_metadata or ()) if isinstance(value, str)}
        guarded = self.auth_methods is None or method in self.auth_methods
        auth = self.auth if self.auth is not None and self.auth.enabled and guarded else None
        if handler.unary_unary or handler.stream_unary:
            inner_unary = handler.unary_unary or handler.stream_unary

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with self._observe(method, carrier, context):
                    try:
                        if auth is not None:
                            auth.check(carrier.get("authorization"))
                        return await inner_unary(request, context)
                    except MilesError as error:
                        await self._abort(context, error)

            factory = (
                grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
            )
            return factory(
                unary_response,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._observe(method, carrier, context):
                try:
                    if auth is not None:
                        auth.check(carrier.get("authorization"))
                    async for response in inner_stream(request, context):
                        yield response
                except MilesError as error:
                    await self._abort(context, error)

        factory = (
            grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        )
        return factory(
            stream_response,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, error: MilesError) -> None:
        context.set_trailing_metadata(_error_metadata(error))
        await context.abort(error.grpc_status, error.message)

    def _observe(self, method: str, carrier: dict[str, str], context: grpc.aio.ServicerContext) -> _CallObserver:
        return _CallObserver(self, method, carrier, context)


class _CallObserver:
    """Context manager: a server span plus count/latency metrics around one call."""

    def __init__(
        self, owner: _ServerInterceptor, method: str, carrier: dict[str, str], context: grpc.aio.ServicerContext
    ) -> None:
        self.owner = owner
        self.method = method
        self.context = context
        self.span_cm = owner.tracer.start_as_current_span(
            method.lstrip("/"), context=extract_context(carrier), kind=SpanKind.SERVER
        )
        self.start_s = 0.0

    def __enter__(self) -> trace.Span:
        self.start_s = time.perf_counter()
        span = self.span_cm.__enter__()
        span.set_attribute("rpc.system", "grpc")
        span.set_attribute("rpc.method", self.method)
        return span

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        code = self.context.code() if hasattr(self.context, "code") else None
        if code is None:
            code = grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
        code_name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        span = trace.get_current_span()
        span.set_attribute("rpc.grpc.status_code", code_name)
        if code_name not in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "ABORTED"):
            span.set_status(Status(StatusCode.ERROR))
        self.owner.requests_total.labels(self.method, code_name).inc()
        self.owner.request_duration_s.labels(self.method).observe(time.perf_counter() - self.start_s)
        self.span_cm.__exit__(exc_type, exc, tb)


@dataclass
class GrpcServer:
    """A started-or-not aio server plus its health servicer."""

    server: grpc.aio.Server
    health_servicer: health.aio.HealthServicer
    service_names: tuple[str, ...]
    port: int

    async def start(self) -> None:
        await self.server.start()
        for name in (*self.service_names, ""):
            await self.health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, then let in-flight calls finish for up to grace_s before cancelling them."""
        await self.health_servicer.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def build_grpc_server(
    *,
    servicers: Sequence[tuple[AddServicerFn, Any]],
    service_names: Sequence[str],
    metrics: Metrics,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = 256 * 1024 * 1024,
    max_receive_message_bytes: int | None = None,
    auth: BearerAuth | None = None,
    auth_methods: Collection[str] | None = None,
) -> GrpcServer:
    """An aio server with health, reflection and the miles interceptor; port 0 binds a free port.

    `service_names` are the full names (e.g. "miles.buffer.v1.BufferService") reported by health and reflection.
    `max_receive_message_bytes` (default: `max_message_bytes`) bounds requests: gRPC refuses a larger one with
    RESOURCE_EXHAUSTED from its length prefix, before the bytes reach Python.
    """
    server = grpc.aio.server(
        interceptors=[_ServerInterceptor(metrics, auth, auth_methods)],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_receive_message_bytes or max_message_bytes),
        ],
    )
    for add_servicer, servicer in servicers:
        add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    return GrpcServer(
        server=server, health_servicer=health_servicer, service_names=tuple(service_names), port=bound_port
    )
