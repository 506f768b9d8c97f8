"""Settings of the trainer (environment prefix MILES_TRAINER_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class TrainerSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("TRAINER")

    port: int = 50052
    """gRPC listening port."""

    metrics_port: int = 51052
    """HTTP port for /healthz, /readyz and /metrics."""
