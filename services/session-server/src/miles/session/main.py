"""Entry point of miles-session-server: load settings, build the store, models, engine client and core, serve."""

from __future__ import annotations

import argparse
import asyncio
import logging

from fastapi import FastAPI

from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.session.adapters import JobAdapters
from miles.session.core import SessionCore
from miles.session.exports import ExportProcesses
from miles.session.http_api import build_app
from miles.session.metrics import SessionMetrics
from miles.session.model_assets import ModelRegistry
from miles.session.settings import SessionSettings
from miles.session.store import make_store
from miles.session.streaming import StreamingTurns
from miles.session.tree_turns import TreeLimits
from miles.session.turns import TurnRunner
from miles.session.upstream import EngineClient
from miles.session.views import SessionViews

SERVICE = "session"
logger = logging.getLogger(__name__)


def build_service(settings: SessionSettings, metrics: Metrics, *, models: ModelRegistry | None = None) -> FastAPI:
    """The whole service as an ASGI app (also used in-process by tests, which may share one `models` cache)."""
    store = make_store(settings)
    models = models or ModelRegistry(settings.model_cache_size)
    engine = EngineClient(
        settings.upstream_url,
        timeout_s=settings.upstream_timeout_s,
        connect_timeout_s=settings.upstream_connect_timeout_s,
        max_connections=settings.upstream_max_connections,
        retry_after_s=settings.upstream_retry_after_s,
    )
    session_metrics = SessionMetrics(metrics)
    tree_limits = TreeLimits(max_nodes=settings.max_tree_nodes, max_tokens=settings.max_tree_tokens)
    adapters = JobAdapters(store, session_metrics, wait_s=settings.adapter_wait_s)
    turns = TurnRunner(
        store=store, models=models, engine=engine, metrics=session_metrics, tree_limits=tree_limits, adapters=adapters
    )
    core = SessionCore(settings=settings, store=store, models=models, turns=turns, metrics=session_metrics)
    streams = StreamingTurns(turns=turns, engine=engine, adapters=adapters, metrics=session_metrics)
    views = SessionViews(store=store, models=models, metrics=session_metrics)
    exports = ExportProcesses(settings, views, session_metrics)

    async def close() -> None:
        await exports.close()
        await engine.close()
        await store.close()

    operator_token = settings.operator_token.get_secret_value()
    if not operator_token:
        logger.warning("no operator_token: operator routes are open to local callers (loopback development mode)")
    return build_app(
        core,
        adapters,
        streams,
        exports,
        metrics,
        operator_token=operator_token,
        max_body_bytes=settings.max_body_bytes,
        on_shutdown=close,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-session-server", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(SessionSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    app = build_service(settings, Metrics(SERVICE))
    asyncio.run(
        serve_async(http_app=app, http_host=settings.host, http_port=settings.port, grace_s=settings.shutdown_grace_s)
    )
