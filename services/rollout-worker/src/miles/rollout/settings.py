"""Settings of the rollout-worker (environment prefix MILES_ROLLOUT_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class RolloutSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("ROLLOUT")

    port: int = 8083
    """HTTP listening port."""
