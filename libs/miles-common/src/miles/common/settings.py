"""The settings base every service derives its one settings class from.

A service declares `class BufferSettings(ServiceSettings)` with `model_config = service_config("BUFFER")`,
documents every field with a docstring, and calls `load_settings(BufferSettings)` once in `main()`. Invalid
values stop the process at start-up with one readable message listing every bad field — never later, per
request. The same field names appear in helm/miles/values.yaml.

Sources, highest precedence first: explicit overrides (CLI flags), environment variables, then a JSON file
named by the environment variable `MILES_<SERVICE>_CONFIG_FILE` (how per-job processes get their part of a
job spec: the controller writes it, Kubernetes mounts it from the job's ConfigMap), then the defaults.
"""

from __future__ import annotations

import os
from typing import Any, Literal, TypeVar

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from miles.common.errors import ConfigError

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


def service_config(service_env_name: str) -> SettingsConfigDict:
    """Settings config for one service: env prefix MILES_<SERVICE>_, unknown keys refused, nested via "__"."""
    return SettingsConfigDict(
        env_prefix=f"MILES_{service_env_name.upper()}_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
    )


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses add their own and set model_config = service_config(NAME)."""

    model_config = service_config("SERVICE")

    host: str = "127.0.0.1"
    """Interface the service binds to (0.0.0.0 in containers)."""

    port: int = 0
    """Main listening port (HTTP for HTTP services, gRPC for gRPC services); 0 picks a free port."""

    metrics_port: int = 0
    """HTTP port serving /healthz, /readyz and /metrics for gRPC services; 0 picks a free port. HTTP
    services serve these on their main port and ignore this field."""

    log_level: LogLevel = "INFO"
    """Minimum level of log records written."""

    log_json: bool = True
    """Write logs as one JSON object per line (false: human-readable lines for local debugging)."""

    shutdown_grace_s: float = 10.0
    """On SIGTERM, seconds in-flight requests get to finish before the server stops."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Overrides, then env, then the JSON file named by MILES_<SERVICE>_CONFIG_FILE (if set), then defaults."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get(f"{settings_cls.model_config.get('env_prefix', '')}CONFIG_FILE")
        if config_file:
            if not os.path.isfile(config_file):
                raise ConfigError(f"config file {config_file!r} does not exist", field="config_file")
            sources.append(JsonConfigSettingsSource(settings_cls, json_file=config_file))
        return tuple(sources)


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def load_settings(settings_class: type[SettingsT], **overrides: Any) -> SettingsT:
    """Build and validate settings from the environment (and explicit overrides, e.g. from CLI flags).

    Raises ConfigError naming every invalid field and the environment variable that sets it.
    """
    try:
        return settings_class(**overrides)
    except ValidationError as exc:
        prefix = settings_class.model_config.get("env_prefix", "")
        problems = []
        for error in exc.errors():
            if not error["loc"]:  # a model-level validator: no single field to name
                problems.append(f"settings: {error['msg']}")
                continue
            location = ".".join(str(part) for part in error["loc"])
            env_name = f"{prefix}{location.replace('.', '__')}".upper()
            problems.append(f"{location} ({env_name}): {error['msg']}")
        first_location = exc.errors()[0]["loc"] if exc.errors() else ()
        raise ConfigError(
            f"invalid {settings_class.__name__}: " + "; ".join(problems),
            field=str(first_location[0]) if first_location else None,
        ) from None
