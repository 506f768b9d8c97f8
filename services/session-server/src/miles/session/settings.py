"""Settings of the session-server (environment prefix MILES_SESSION_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class SessionSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("SESSION")

    port: int = 8081
    """HTTP listening port."""
