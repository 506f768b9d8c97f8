"""Entry point of miles-rollout-worker: load settings, build the job's worker, serve probes while it rolls out.

Without a job (`job_id` empty) only the probes are served. The process exits non-zero if the scheduler dies
unexpectedly, so that its supervisor (Kubernetes, the local launcher) restarts it; a restart resumes from the
job's cursor in Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from miles.common.logs import configure_logging
from miles.common.serve import bind_socket, serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics, setup_tracing
from miles.rollout.core import RolloutWorker
from miles.rollout.http_api import SERVICE, build_app
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.settings import RolloutSettings


async def run(settings: RolloutSettings) -> int:
    # Bound before the worker starts: an environment server it spawns listens on an ephemeral port, which the
    # kernel could otherwise hand out from under ours (seen in CI as "Address already in use").
    http_socket = bind_socket(settings.host, settings.port)
    metrics = Metrics(SERVICE)
    rollout_metrics = RolloutMetrics(metrics)
    worker = await RolloutWorker.build(settings, rollout_metrics) if settings.job_id else None
    stop = asyncio.Event()
    on_shutdown = []
    if worker is not None:
        await worker.start()
        on_shutdown.append(worker.stop)

        async def stop_on_failure() -> None:
            await worker.failed.wait()
            stop.set()

        watcher = asyncio.create_task(stop_on_failure())
    await serve_async(
        http_app=build_app(metrics, worker),
        http_socket=http_socket,
        grace_s=settings.shutdown_grace_s,
        on_shutdown=on_shutdown,
        stop_event=stop,
    )
    if worker is not None:
        watcher.cancel()
        return 1 if worker.failed.is_set() else 0
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="miles-rollout-worker", description=__doc__)
    parser.parse_args(argv)
    settings = load_settings(RolloutSettings)
    configure_logging(SERVICE, settings.log_level, json_lines=settings.log_json)
    # Agents' HTTP clients (openai uses httpx) would log every request at INFO: thousands per minute.
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(settings.log_level)))
    setup_tracing(SERVICE)
    sys.exit(asyncio.run(run(settings)))
