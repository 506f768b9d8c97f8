"""Settings of the controller (environment prefix MILES_CONTROLLER_), validated at start-up."""

from __future__ import annotations

from miles.common.settings import ServiceSettings, service_config


class ControllerSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("CONTROLLER")

    port: int = 8080
    """HTTP listening port."""
