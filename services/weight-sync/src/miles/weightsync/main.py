"""Entry point of miles-weight-sync: load settings, build the core, serve gRPC (WeightSyncService) and the
metrics/probe app until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from miles.common.grpc_server import build_grpc_server
from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.weightsync.grpc_api import SERVICE_NAME, WeightSyncServicer, add_servicer
from miles.weightsync.memory import tune_malloc_for_streaming
from miles.weightsync.service import WeightSyncCore
from miles.weightsync.settings import WeightsyncSettings

SERVICE = "weightsync"
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


async def run(settings: WeightsyncSettings) -> None:
    metrics = Metrics(SERVICE)
    core = WeightSyncCore(settings, metrics)
    await core.start()
    grpc_server = build_grpc_server(
        servicers=[(add_servicer, WeightSyncServicer(core))],
        service_names=[SERVICE_NAME],
        metrics=metrics,
        host=settings.host,
        port=settings.port,
        max_message_bytes=_MAX_MESSAGE_BYTES,
    )
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
