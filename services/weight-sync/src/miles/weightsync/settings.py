"""Settings of the weight-sync (environment prefix MILES_WEIGHTSYNC_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class WeightsyncSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("WEIGHTSYNC")

    port: int = 50053
    """gRPC listening port."""

    metrics_port: int = 51053
    """HTTP port for /healthz, /readyz and /metrics."""
