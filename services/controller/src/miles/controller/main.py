"""Entry point of miles-controller: load settings, pick the backend, build the store, supervisor and API, serve."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from miles.common.logs import configure_logging
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.controller.backends.base import JobBackend
from miles.controller.core import JobService
from miles.controller.http_api import build_app
from miles.controller.metrics import ControllerMetrics
from miles.controller.settings import ControllerSettings
from miles.controller.shared import SharedServicesClient
from miles.controller.store import JobStore
from miles.controller.supervisor import Supervisor

SERVICE = "controller"
log = logging.getLogger(__name__)


def make_backend(settings: ControllerSettings) -> JobBackend:
    """The backend `settings.backend` names; only its module is imported."""
    if settings.backend == "kubernetes":
        from miles.controller.backends.kubernetes import KubernetesJobBackend

        kubernetes_backend: JobBackend = KubernetesJobBackend.from_settings(settings)
        return kubernetes_backend
    from miles.controller.backends.local import LocalJobBackend

    backend: JobBackend = LocalJobBackend(
        shared=settings.shared_services(), state_dir=settings.state_dir, **settings.local_options
    )
    return backend


def build_service(settings: ControllerSettings, metrics: Metrics, *, backend: JobBackend | None = None) -> FastAPI:
    """The whole controller as an ASGI app; its lifespan runs the supervisor (tests pass their own backend)."""
    job_backend = backend if backend is not None else make_backend(settings)
    store = JobStore(settings.redis_url, key_prefix=settings.key_prefix, max_events=settings.max_events_per_job)
    shared = SharedServicesClient(settings.shared_services(), timeout_s=settings.shared_call_timeout_s)
    controller_metrics = ControllerMetrics(metrics)
    supervisor = Supervisor(
        store=store, backend=job_backend, shared=shared, settings=settings, metrics=controller_metrics
    )
    service = JobService(store=store, supervisor=supervisor, settings=settings, metrics=controller_metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(supervisor.run(stop), name="supervisor")
        try:
            yield
        finally:
            stop.set()
            supervisor.wake()
            try:
                await asyncio.wait_for(task, timeout=settings.shutdown_grace_s)
            except TimeoutError:
                log.warning("the supervisor did not stop within shutdown_grace_s; cancelled it")
            await supervisor.close()
            await job_backend.close()
            await shared.close()
            await store.close()

    tokens = [token.get_secret_value() for token in settings.api_tokens]
    if not tokens:
        log.warning("no api_tokens: the job API is open to local callers (loopback development mode)")
    return build_app(service, metrics, api_tokens=tokens, lifespan=lifespan, readiness_checks={"redis": store.ping})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-controller", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(ControllerSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    setup_tracing(SERVICE)
    app = build_service(settings, Metrics(SERVICE))
    asyncio.run(
        serve_async(http_app=app, http_host=settings.host, http_port=settings.port, grace_s=settings.shutdown_grace_s)
    )
