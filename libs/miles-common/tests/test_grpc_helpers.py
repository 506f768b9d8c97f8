"""The shared gRPC helpers, over a real socket: health, an echo RPC, trace propagation, error mapping."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from miles.common import errors
from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.telemetry import Metrics, current_trace_id_hex
from miles.proto.testing.v1 import echo_pb2, echo_pb2_grpc

ECHO_SERVICE = "miles.testing.v1.EchoService"


class EchoServicer(echo_pb2_grpc.EchoServiceServicer):
    async def Echo(self, request: echo_pb2.EchoRequest, context: grpc.aio.ServicerContext) -> echo_pb2.EchoResponse:
        if request.fail_with:
            error_class = getattr(errors, request.fail_with)
            raise error_class(f"asked to fail with {request.fail_with}", field="message", retry_after_s=2.0)
        return echo_pb2.EchoResponse(message=request.message, server_trace_id=current_trace_id_hex())

    async def EchoStream(
        self, request: echo_pb2.EchoStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[echo_pb2.EchoStreamResponse]:
        if request.repeat > 1000:
            raise errors.InvalidArgumentError("repeat must be <= 1000", field="repeat")
        for index in range(request.repeat):
            yield echo_pb2.EchoStreamResponse(message=f"{request.message}-{index}")


@pytest.fixture
async def echo_server() -> AsyncIterator[GrpcServer]:
    metrics = Metrics("echo")
    server = build_grpc_server(
        servicers=[(echo_pb2_grpc.add_EchoServiceServicer_to_server, EchoServicer())],
        service_names=[ECHO_SERVICE],
        metrics=metrics,
    )
    await server.start()
    server.metrics = metrics  # type: ignore[attr-defined]
    yield server
    await server.stop(grace_s=1.0)


async def test_health_service_reports_serving_for_registered_service(echo_server: GrpcServer) -> None:
    async with create_channel(f"127.0.0.1:{echo_server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        overall = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        echo = await stub.Check(health_pb2.HealthCheckRequest(service=ECHO_SERVICE))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Check(health_pb2.HealthCheckRequest(service="miles.nope.v1.Nope"))
    assert overall.status == health_pb2.HealthCheckResponse.SERVING
    assert echo.status == health_pb2.HealthCheckResponse.SERVING
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_turns_not_serving_on_graceful_shutdown(echo_server: GrpcServer) -> None:
    await echo_server.health_servicer.enter_graceful_shutdown()
    async with create_channel(f"127.0.0.1:{echo_server.port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=ECHO_SERVICE))
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_echo_rpc_server_span_carries_callers_trace_id(
    echo_server: GrpcServer, span_exporter: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("test-client")
    async with create_channel(f"127.0.0.1:{echo_server.port}") as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        with tracer.start_as_current_span("client-call") as client_span:
            response = await stub.Echo(echo_pb2.EchoRequest(message="hello"))
            client_trace_id = format(client_span.get_span_context().trace_id, "032x")
    assert response.message == "hello"
    assert response.server_trace_id == client_trace_id
    server_spans = [span for span in span_exporter.get_finished_spans() if span.kind == trace.SpanKind.SERVER]
    assert [span.name for span in server_spans] == ["miles.testing.v1.EchoService/Echo"]
    server_span = server_spans[0]
    assert format(server_span.context.trace_id, "032x") == client_trace_id
    assert server_span.parent is not None
    assert server_span.parent.span_id == client_span.get_span_context().span_id


@pytest.mark.parametrize(
    ("error_name", "status"),
    [
        ("NotFoundError", grpc.StatusCode.NOT_FOUND),
        ("InvalidArgumentError", grpc.StatusCode.INVALID_ARGUMENT),
        ("ResourceExhaustedError", grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("ConflictError", grpc.StatusCode.ABORTED),
    ],
)
async def test_miles_error_becomes_its_status_and_maps_back(
    echo_server: GrpcServer, error_name: str, status: grpc.StatusCode
) -> None:
    async with create_channel(f"127.0.0.1:{echo_server.port}") as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Echo(echo_pb2.EchoRequest(message="x", fail_with=error_name))
    assert failure.value.code() == status
    mapped = error_from_rpc_error(failure.value)
    assert type(mapped) is getattr(errors, error_name)
    assert mapped.field == "message"
    assert mapped.retry_after_s == 2.0
    assert "asked to fail" in mapped.message
    line = f'miles_echo_grpc_requests_total{{code="{status.name}",method="/{ECHO_SERVICE}/Echo"}} 1.0'
    # The server counts the call as its handler unwinds, which may be just after the client has the status.
    for _ in range(200):
        if line in echo_server.metrics.exposition().decode():  # type: ignore[attr-defined]
            break
        await asyncio.sleep(0.01)
    assert line in echo_server.metrics.exposition().decode()  # type: ignore[attr-defined]


async def test_streaming_rpc_through_interceptor(echo_server: GrpcServer) -> None:
    async with create_channel(f"127.0.0.1:{echo_server.port}") as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        messages = [reply.message async for reply in stub.EchoStream(echo_pb2.EchoStreamRequest(message="m", repeat=3))]
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            async for _ in stub.EchoStream(echo_pb2.EchoStreamRequest(message="m", repeat=5000)):
                pass
    assert messages == ["m-0", "m-1", "m-2"]
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_from_rpc_error(failure.value).field == "repeat"


async def test_reflection_lists_registered_services(echo_server: GrpcServer) -> None:
    async with create_channel(f"127.0.0.1:{echo_server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [service.name async for response in responses for service in response.list_services_response.service]
    assert ECHO_SERVICE in names
    assert "grpc.health.v1.Health" in names


async def test_a_cancelled_status_of_a_task_being_cancelled_stays_a_cancellation() -> None:
    cancelled = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "locally")
    assert type(error_from_rpc_error(cancelled)) is errors.MilesError, "a CANCELLED nobody asked for is an error"
    started = asyncio.Event()

    async def translate_while_cancelled() -> errors.MilesError:
        started.set()
        # swallowed, as grpc does when it turns a cancellation into the CANCELLED status
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        return error_from_rpc_error(cancelled)

    task = asyncio.create_task(translate_while_cancelled())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
