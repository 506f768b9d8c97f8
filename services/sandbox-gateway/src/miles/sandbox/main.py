"""Entry point of miles-sandbox-gateway: load settings, start the backend, serve gRPC plus the HTTP facade.

The backend is started before anything listens: a local backend without bubblewrap (or on a host that cannot
create namespaces) stops the process here with a message saying how to fix it; it never serves unsandboxed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from miles.common.errors import ConfigError
from miles.common.grpc_server import build_grpc_server
from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.proto.sandbox.v1 import sandbox_pb2_grpc
from miles.sandbox.access import SandboxAccess
from miles.sandbox.backend import make_backend
from miles.sandbox.core import SandboxGateway
from miles.sandbox.grpc_api import SERVICE_NAME, SandboxServicer
from miles.sandbox.http_api import build_router
from miles.sandbox.metrics import SandboxMetrics
from miles.sandbox.openapi_docs import state_request_bounds
from miles.sandbox.settings import SandboxSettings

SERVICE = "sandbox"
GRPC_HEADROOM_BYTES = 4 * 1024 * 1024
log = logging.getLogger(__name__)


async def run(settings: SandboxSettings) -> None:
    metrics = Metrics(SERVICE)
    gateway = SandboxGateway(settings, make_backend(settings), SandboxMetrics(metrics))
    await gateway.start()
    # Checked per call by the servicer and the routes (a job's capability depends on the ids a call names), not by
    # the common interceptor's BearerAuth; health, reflection and the probes stay open.
    access = SandboxAccess(settings.operator_token.get_secret_value(), gateway)
    grpc_server = build_grpc_server(
        servicers=[(sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, SandboxServicer(gateway, access))],
        service_names=[SERVICE_NAME],
        metrics=metrics,
        host=settings.host,
        port=settings.port,
        # Oversized writes past this are refused by gRPC itself; below it, by the gateway naming the field.
        max_message_bytes=max(settings.max_write_bytes, settings.max_read_bytes) + GRPC_HEADROOM_BYTES,
    )
    app = create_http_app(
        service=SERVICE,
        metrics=metrics,
        title="miles sandbox-gateway",
        openapi_hooks=[state_request_bounds(settings)],
    )
    app.include_router(build_router(gateway, access))
    await serve_async(
        http_app=app,
        http_host=settings.host,
        http_port=settings.metrics_port,
        grpc_server=grpc_server,
        grace_s=settings.shutdown_grace_s,
        on_shutdown=[gateway.close],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-sandbox-gateway", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(SandboxSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    try:
        asyncio.run(run(settings))
    except ConfigError as exc:
        log.error("cannot start", extra={"error": exc.message, "field": exc.field})
        raise SystemExit(f"miles-sandbox-gateway: {exc.message}") from None
