"""Settings of the engine (environment prefix MILES_ENGINE_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class EngineSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("ENGINE")

    port: int = 30000
    """HTTP listening port."""
