"""Bearer tokens on control endpoints: HTTP dependency, gRPC interceptor, job capabilities, the settings rule."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from fastapi import APIRouter, Depends
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from miles.common.auth import (
    AUTH_RESPONSES,
    MIN_TOKEN_CHARS,
    BearerAuth,
    check_token_setting,
    job_capability,
)
from miles.common.grpc_client import create_channel
from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.http import create_http_app
from miles.common.telemetry import Metrics
from miles.proto.testing.v1 import echo_pb2, echo_pb2_grpc

TOKEN = "t" * MIN_TOKEN_CHARS
OTHER = "o" * MIN_TOKEN_CHARS


def _app(auth: BearerAuth) -> TestClient:
    app = create_http_app(service="authtest", metrics=Metrics("authtest"))
    router = APIRouter(prefix="/admin", dependencies=[Depends(auth.http_dependency)], responses=AUTH_RESPONSES)

    @router.post("/drain")
    async def drain() -> dict[str, bool]:
        return {"drained": True}

    app.include_router(router)
    return TestClient(app)


def test_http_route_needs_its_token() -> None:
    client = _app(BearerAuth([TOKEN], what="the admin API"))
    missing = client.post("/admin/drain")
    wrong = client.post("/admin/drain", headers={"authorization": f"Bearer {OTHER}"})
    basic = client.post("/admin/drain", headers={"authorization": f"Basic {TOKEN}"})
    right = client.post("/admin/drain", headers={"authorization": f"Bearer {TOKEN}"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "unauthenticated")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (403, "permission_denied")
    assert basic.status_code == 401
    assert right.json() == {"drained": True}
    assert client.get("/healthz").status_code == 200  # probes stay open
    documented = client.get("/openapi.json").json()["paths"]["/admin/drain"]["post"]["responses"]
    assert {"401", "403"} <= set(documented)


def test_without_tokens_the_route_is_open() -> None:
    assert _app(BearerAuth([], what="the admin API")).post("/admin/drain").json() == {"drained": True}


def test_several_tokens_are_accepted() -> None:
    client = _app(BearerAuth([TOKEN, OTHER], what="the admin API"))
    assert client.post("/admin/drain", headers={"authorization": f"Bearer {OTHER}"}).status_code == 200


def test_job_capability_is_per_job_and_per_secret() -> None:
    token = job_capability(TOKEN, "sandbox", "job-a")
    assert token == job_capability(TOKEN, "sandbox", "job-a")
    assert token != job_capability(TOKEN, "sandbox", "job-b")
    assert token != job_capability(OTHER, "sandbox", "job-a")
    assert token != job_capability(TOKEN, "engine", "job-a")
    assert len(token) >= MIN_TOKEN_CHARS


def test_settings_rule() -> None:
    check_token_setting("", host="127.0.0.1", field="admin_token")
    check_token_setting(TOKEN, host="0.0.0.0", field="admin_token")
    with pytest.raises(ValueError, match=r"required when host is '0\.0\.0\.0'"):
        check_token_setting("", host="0.0.0.0", field="admin_token")
    with pytest.raises(ValueError, match=f"at least {MIN_TOKEN_CHARS}"):
        check_token_setting("short", host="127.0.0.1", field="admin_token")


class _Echo(echo_pb2_grpc.EchoServiceServicer):
    async def Echo(self, request: echo_pb2.EchoRequest, context: grpc.aio.ServicerContext) -> echo_pb2.EchoResponse:
        return echo_pb2.EchoResponse(message=request.message)

    async def EchoStream(
        self, request: echo_pb2.EchoStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[echo_pb2.EchoStreamResponse]:
        yield echo_pb2.EchoStreamResponse(message=request.message)


@pytest.fixture
async def guarded_server() -> AsyncIterator[GrpcServer]:
    server = build_grpc_server(
        servicers=[(echo_pb2_grpc.add_EchoServiceServicer_to_server, _Echo())],
        service_names=["miles.testing.v1.EchoService"],
        metrics=Metrics("authgrpc"),
        auth=BearerAuth([TOKEN], what="the echo service"),
    )
    await server.start()
    yield server
    await server.stop(grace_s=1.0)


@pytest.mark.parametrize(
    ("token", "code"), [("", grpc.StatusCode.UNAUTHENTICATED), (OTHER, grpc.StatusCode.PERMISSION_DENIED)]
)
async def test_grpc_calls_need_the_token(guarded_server: GrpcServer, token: str, code: grpc.StatusCode) -> None:
    async with create_channel(f"127.0.0.1:{guarded_server.port}", bearer_token=token) as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Echo(echo_pb2.EchoRequest(message="x"))
        with pytest.raises(grpc.aio.AioRpcError) as streaming:
            async for _ in stub.EchoStream(echo_pb2.EchoStreamRequest(message="x", repeat=1)):
                pass
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert unary.value.code() == code
    assert streaming.value.code() == code
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


async def test_grpc_auth_can_guard_only_some_methods() -> None:
    server = build_grpc_server(
        servicers=[(echo_pb2_grpc.add_EchoServiceServicer_to_server, _Echo())],
        service_names=["miles.testing.v1.EchoService"],
        metrics=Metrics("authgrpcsome"),
        auth=BearerAuth([TOKEN], what="the echo service"),
        auth_methods={"/miles.testing.v1.EchoService/EchoStream"},
    )
    await server.start()
    try:
        async with create_channel(f"127.0.0.1:{server.port}") as channel:
            stub = echo_pb2_grpc.EchoServiceStub(channel)
            assert (await stub.Echo(echo_pb2.EchoRequest(message="open"))).message == "open"
            with pytest.raises(grpc.aio.AioRpcError) as streaming:
                async for _ in stub.EchoStream(echo_pb2.EchoStreamRequest(message="x", repeat=1)):
                    pass
        assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(grace_s=1.0)


async def test_grpc_call_with_the_token_passes(guarded_server: GrpcServer) -> None:
    async with create_channel(f"127.0.0.1:{guarded_server.port}", bearer_token=TOKEN) as channel:
        stub = echo_pb2_grpc.EchoServiceStub(channel)
        assert (await stub.Echo(echo_pb2.EchoRequest(message="x"))).message == "x"
        streamed = [r.message async for r in stub.EchoStream(echo_pb2.EchoStreamRequest(message="y", repeat=1))]
    assert streamed == ["y"]
