"""Settings of the rollout-router (environment prefix MILES_ROUTER_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class RouterSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("ROUTER")

    port: int = 8082
    """HTTP listening port."""
