"""HTTP transport of the rollout worker: probes, metrics and the job's status (the worker has no other API)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from miles.common.http import create_http_app
from miles.common.telemetry import Metrics
from miles.rollout.core import RolloutWorker

SERVICE = "rollout"


def build_app(metrics: Metrics, worker: RolloutWorker | None) -> FastAPI:
    checks = {"worker": worker.check_ready} if worker is not None else {}
    app = create_http_app(service=SERVICE, metrics=metrics, readiness_checks=checks, title="miles-rollout-worker")

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        """The job's cursor and this worker's episodes (`{"job_id": ""}` when idle)."""
        if worker is None:
            return {"job_id": "", "idle": True}
        return await worker.status()

    return app
