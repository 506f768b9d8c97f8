"""Entry point of miles-rollout-router: load settings, build the app, serve."""

from __future__ import annotations

import argparse
import asyncio

from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.router.settings import RouterSettings

SERVICE = "router"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-rollout-router", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(RouterSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    app = create_http_app(service=SERVICE, metrics=Metrics(SERVICE))
    asyncio.run(
        serve_async(http_app=app, http_host=settings.host, http_port=settings.port, grace_s=settings.shutdown_grace_s)
    )
