"""HTTP transport of the trainer: probes and metrics only (the control API is gRPC, grpc_api.py).

`/readyz` fails once the loop has failed, so that Kubernetes stops counting a dead trainer as ready while its
process exits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from miles.common.http import create_http_app
from miles.common.telemetry import Metrics
from miles.proto.trainer.v1 import trainer_pb2

if TYPE_CHECKING:
    from miles.trainer.core import Trainer  # imports torch: only where a job runs

SERVICE = "trainer"


def build_http_app(metrics: Metrics, trainer: Trainer | None) -> FastAPI:
    async def trainer_alive() -> None:
        if trainer is not None and trainer.state == trainer_pb2.TRAINER_STATE_FAILED:
            raise RuntimeError(trainer.error)

    return create_http_app(service=SERVICE, metrics=metrics, readiness_checks={"trainer": trainer_alive})
