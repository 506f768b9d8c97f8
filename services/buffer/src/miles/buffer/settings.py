"""Settings of the buffer (environment prefix MILES_BUFFER_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class BufferSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("BUFFER")

    port: int = 50051
    """gRPC listening port."""

    metrics_port: int = 51051
    """HTTP port for /healthz, /readyz and /metrics."""
