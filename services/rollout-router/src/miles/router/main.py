"""Entry point of miles-rollout-router: load settings, build the router, serve HTTP (data plane + admin mirror)
and gRPC (RouterAdminService) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from miles.common.grpc_server import GrpcServer, build_grpc_server
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.proto.router.v1 import router_pb2_grpc
from miles.router.core import RouterService
from miles.router.grpc_api import SERVICE_NAME, RouterAdminServicer
from miles.router.http_api import create_app
from miles.router.settings import RouterSettings

SERVICE = "router"

log = logging.getLogger(__name__)


def parse_overrides(argv: list[str] | None) -> dict[str, Any]:
    """Command-line flags that override settings (everything else comes from MILES_ROUTER_* variables)."""
    parser = argparse.ArgumentParser(prog="miles-rollout-router", description=__doc__)
    parser.add_argument("--policy", choices=["session_affinity", "cache_aware", "least_load", "round_robin"])
    parser.add_argument("--engine-url", action="append", dest="engine_urls", help="engine in the default pool")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    return {name: value for name, value in vars(args).items() if value is not None}


def build_admin_grpc(service: RouterService, settings: RouterSettings, metrics: Metrics) -> GrpcServer | None:
    if settings.admin_grpc_port < 0:
        return None
    return build_grpc_server(
        servicers=[(router_pb2_grpc.add_RouterAdminServiceServicer_to_server, RouterAdminServicer(service.admin))],
        service_names=[SERVICE_NAME],
        metrics=metrics,
        host=settings.host,
        port=settings.admin_grpc_port,
        auth=service.admin_auth,
    )


async def run(settings: RouterSettings) -> None:
    metrics = Metrics(SERVICE)
    service = RouterService.build(settings, metrics)
    if not service.admin_auth.enabled:
        log.warning("no admin_token: the admin API is open to local callers (loopback development mode)")
    await service.start()
    await serve_async(
        http_app=create_app(service, metrics),
        http_host=settings.host,
        http_port=settings.port,
        grpc_server=build_admin_grpc(service, settings, metrics),
        grace_s=settings.shutdown_grace_s,
        on_shutdown=[service.stop],
    )


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(RouterSettings, **parse_overrides(argv))
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    asyncio.run(run(settings))
