"""Entry point of miles-weight-sync: load settings, build the core, serve gRPC (WeightSyncService, behind
settings.auth_token) and the metrics/probe app (open: it has no control routes) until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging

from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.grpc_api import build_server
from miles.weightsync.memory import tune_malloc_for_streaming
from miles.weightsync.settings import WeightsyncSettings

SERVICE = "weightsync"

log = logging.getLogger(__name__)


async def run(settings: WeightsyncSettings) -> None:
    if not settings.auth_token.get_secret_value():
        log.warning("no auth_token: WeightSyncService is open to local callers (loopback development mode)")
    metrics = Metrics(SERVICE)
    core = WeightSyncCore(settings, metrics)
    await core.start()
    grpc_server = build_server(core, metrics, port=settings.port)
    app = create_http_app(service=SERVICE, metrics=metrics, title="miles-weight-sync")
    await serve_async(
        http_app=app,
        http_host=settings.host,
        http_port=settings.metrics_port,
        grpc_server=grpc_server,
        grace_s=settings.shutdown_grace_s,
        on_shutdown=[core.close],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-weight-sync", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(WeightsyncSettings)
    tune_malloc_for_streaming()
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    asyncio.run(run(settings))
