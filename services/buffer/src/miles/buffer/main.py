"""Entry point of miles-buffer: load settings, connect Redis, build the core, serve gRPC plus the metrics app."""

from __future__ import annotations

import argparse
import asyncio

from miles.buffer.core import Buffer
from miles.buffer.grpc_api import CONTROL_METHODS, SERVICE_NAME, BufferServicer, add_buffer_service
from miles.buffer.metrics import BufferMetrics
from miles.buffer.settings import REQUEST_HEADROOM_BYTES, BufferSettings
from miles.buffer.store import RedisStore, check_redis_persistence, connect_redis
from miles.common.auth import BearerAuth
from miles.common.grpc_server import build_grpc_server
from miles.common.http import create_http_app
from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing

SERVICE = "buffer"


async def run(settings: BufferSettings) -> None:
    metrics = Metrics(SERVICE)
    client = connect_redis(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        socket_timeout_s=settings.redis_socket_timeout_s,
    )
    await check_redis_persistence(client, settings.redis_persistence_check)
    store = RedisStore(
        client,
        key_prefix=settings.key_prefix,
        dedupe_window_s=settings.dedupe_window_s,
        dedupe_max_ids=settings.dedupe_max_ids_per_job,
    )
    buffer = Buffer(store, settings, BufferMetrics(metrics))
    grpc_server = build_grpc_server(
        servicers=[(add_buffer_service, BufferServicer(buffer))],
        service_names=[SERVICE_NAME],
        metrics=metrics,
        host=settings.host,
        port=settings.port,
        max_receive_message_bytes=settings.max_group_bytes + REQUEST_HEADROOM_BYTES,
        auth=BearerAuth([settings.operator_token.get_secret_value()], what="the buffer's job-control API"),
        auth_methods=CONTROL_METHODS,
    )
    app = create_http_app(service=SERVICE, metrics=metrics, readiness_checks={"redis": buffer.ping})
    buffer.start_background()
    await serve_async(
        http_app=app,
        http_host=settings.host,
        http_port=settings.metrics_port,
        grpc_server=grpc_server,
        grace_s=settings.shutdown_grace_s,
        on_shutdown=[buffer.close],
        on_stopping=[buffer.stop_waiting],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-buffer", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(BufferSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    asyncio.run(run(settings))
