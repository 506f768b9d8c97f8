"""Entry point of miles-trainer: load settings, build the gRPC server and the metrics app, serve."""

from __future__ import annotations

import argparse
import asyncio

from miles.common.grpc_server import build_grpc_server
from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.trainer.settings import TrainerSettings

SERVICE = "trainer"


async def run(settings: TrainerSettings) -> None:
    metrics = Metrics(SERVICE)
    grpc_server = build_grpc_server(
        servicers=[], service_names=[], metrics=metrics, host=settings.host, port=settings.port
    )
    app = create_http_app(service=SERVICE, metrics=metrics)
    await serve_async(
        http_app=app,
        http_host=settings.host,
        http_port=settings.metrics_port,
        grpc_server=grpc_server,
        grace_s=settings.shutdown_grace_s,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-trainer", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(TrainerSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    asyncio.run(run(settings))
