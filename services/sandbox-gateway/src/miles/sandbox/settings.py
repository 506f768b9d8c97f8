"""Settings of the sandbox-gateway (environment prefix MILES_SANDBOX_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class SandboxSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("SANDBOX")

    port: int = 50054
    """gRPC listening port."""

    metrics_port: int = 51054
    """HTTP port for /healthz, /readyz and /metrics."""
