"""A service with both an HTTP and a gRPC server is ready only once the gRPC server accepts calls (serve_async
starts HTTP first, so /readyz would otherwise answer while the gRPC port refuses connections)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from miles.common.grpc_server import build_grpc_server
from miles.common.http import create_http_app
from miles.common.serve import bind_socket, serve_async
from miles.common.telemetry import Metrics
from miles.common.testing import free_port


async def test_readyz_waits_for_the_grpc_server() -> None:
    metrics = Metrics("servetest")
    app = create_http_app(service="servetest", metrics=metrics)
    grpc_server = build_grpc_server(servicers=[], service_names=[], metrics=metrics)
    release = asyncio.Event()
    original_start = grpc_server.start

    async def slow_start() -> None:
        await release.wait()
        await original_start()

    grpc_server.start = slow_start  # type: ignore[method-assign]
    stop, port = asyncio.Event(), free_port()
    serving = asyncio.create_task(
        serve_async(
            http_app=app, http_port=port, grpc_server=grpc_server, stop_event=stop, handle_signals=False, grace_s=0.1
        )
    )
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        while True:  # the HTTP server comes up first
            try:
                starting = await client.get("/readyz")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.02)
        assert starting.status_code == 503 and "grpc" in starting.json()["failures"]
        release.set()
        for _ in range(500):
            ready = await client.get("/readyz")
            if ready.status_code == 200:
                break
            await asyncio.sleep(0.02)
        assert ready.status_code == 200, ready.text
    stop.set()
    await serving


async def test_a_socket_bound_before_serving_is_the_one_served() -> None:
    """A service that spawns children before it serves binds first (bind_socket) and hands the socket over, so
    that a child's ephemeral port cannot take the service's port in between."""
    metrics = Metrics("servetest")
    app = create_http_app(service="servetest", metrics=metrics)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(OSError):  # the port is held from the bind on, before serving starts
        bind_socket("127.0.0.1", port)
    stop, started = asyncio.Event(), asyncio.Event()
    serving = asyncio.create_task(
        serve_async(
            http_app=app,
            http_socket=sock,
            stop_event=stop,
            handle_signals=False,
            grace_s=0.1,
            on_started=lambda http_port, _grpc: started.set() if http_port == port else None,
        )
    )
    await asyncio.wait_for(started.wait(), 30)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert (await client.get("/healthz")).status_code == 200
    stop.set()
    await serving
