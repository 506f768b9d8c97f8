"""Run a service's HTTP app and/or gRPC server in one event loop until SIGTERM or SIGINT.

On a signal: the gRPC health service turns NOT_SERVING, in-flight calls get `grace_s` to finish, then both
servers stop and `on_shutdown` callbacks run (flush, close connections). Services call
`asyncio.run(serve_async(...))` at the end of `main()`, once their core is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Generator, Sequence

import uvicorn
from fastapi import FastAPI

from miles.common.grpc_server import GrpcServer

log = logging.getLogger(__name__)


class _EmbeddedUvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: serve_async owns SIGTERM/SIGINT for HTTP and gRPC together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free port (read it back with getsockname())."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it
    # Nagle + delayed ACK add ~40 ms to every response.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


SERVER_KEEP_ALIVE_S = 75.0
"""Idle keep-alive connections stay open this long (uvicorn's default is 5 s): longer than every miles client's
pool keeps them (miles.common.http_client), so no client ever sends on a connection the server is closing."""


def _gate_readiness_on(http_app: FastAPI, grpc_serving: asyncio.Event) -> None:
    """/readyz of a service with both servers fails until the gRPC server accepts calls: the HTTP server starts
    first (its lifespan sets up what the gRPC servicers use), so without this gate a caller that waited for
    readiness could reach a gRPC port that is not listening yet (UNAVAILABLE)."""
    checks = getattr(http_app.state, "readiness_checks", None)
    if not isinstance(checks, dict):
        return

    async def grpc_accepts_calls() -> None:
        if not grpc_serving.is_set():
            raise RuntimeError("the gRPC server is not serving yet (starting, or stopping)")

    checks["grpc"] = grpc_accepts_calls  # this serve's event (an app served again gets a new one)


async def serve_async(
    *,
    http_app: FastAPI | None,
    http_host: str = "127.0.0.1",
    http_port: int = 0,
    http_socket: socket.socket | None = None,
    grpc_server: GrpcServer | None = None,
    grace_s: float = 10.0,
    on_started: Callable[[int | None, int | None], None] | None = None,
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    on_stopping: Sequence[Callable[[], None]] = (),
    stop_event: asyncio.Event | None = None,
    handle_signals: bool = True,
) -> None:
    """Serve until a stop signal (or `stop_event` is set, for embedding and tests).

    `on_started(http_port, grpc_port)` runs once both are listening. `on_stopping` callbacks run first when the
    stop comes, before the servers wait `grace_s` for in-flight calls: a service wakes its long-polls there, so
    that they answer at once instead of holding the shutdown for the whole grace. `on_shutdown` runs last.
    `http_socket`, bound earlier with `bind_socket`, replaces `http_host`/`http_port`: a service that starts
    child processes before serving binds first, so that no child's ephemeral port can take its port.
    """
    stop = stop_event or asyncio.Event()
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    http_server: uvicorn.Server | None = None
    http_task: asyncio.Task[object] | None = None
    bound_http_port: int | None = None
    grpc_serving = asyncio.Event()
    if http_app is not None and grpc_server is not None:
        _gate_readiness_on(http_app, grpc_serving)
    if http_app is not None:
        sock = http_socket if http_socket is not None else bind_socket(http_host, http_port)
        bound_http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            http_app,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(grace_s),
            timeout_keep_alive=int(SERVER_KEEP_ALIVE_S),
        )
        http_server = _EmbeddedUvicornServer(config)
        http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
        # uvicorn exposes start-up only as a flag, so poll it.
        while not http_server.started and not http_task.done():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if http_task.done():
            await http_task  # re-raises the start-up failure
    if grpc_server is not None:
        await grpc_server.start()
        grpc_serving.set()
    if on_started is not None:
        on_started(bound_http_port, grpc_server.port if grpc_server else None)
    log.info("serving", extra={"http_port": bound_http_port, "grpc_port": grpc_server.port if grpc_server else None})

    waiters: list[asyncio.Task[object]] = [asyncio.create_task(stop.wait())]
    if http_task is not None:
        waiters.append(http_task)
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down", extra={"grace_s": grace_s})
    for wake in on_stopping:
        wake()
    grpc_serving.clear()
    if grpc_server is not None:
        await grpc_server.stop(grace_s)
    if http_server is not None and http_task is not None:
        http_server.should_exit = True
        await http_task
    for callback in on_shutdown:
        await callback()
    for task in waiters:
        task.cancel()
