"""The settings base: env prefix per service, nested fields, start-up validation that names the variable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import model_validator

from miles.common.errors import ConfigError
from miles.common.settings import ServiceSettings, load_settings, service_config


class ExampleSettings(ServiceSettings):
    model_config = service_config("EXAMPLE")

    capacity_groups: int = 10
    """Groups held per job."""


def test_env_prefix_sets_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_EXAMPLE_CAPACITY_GROUPS", "42")
    monkeypatch.setenv("MILES_EXAMPLE_PORT", "9999")
    settings = load_settings(ExampleSettings)
    assert settings.capacity_groups == 42
    assert settings.port == 9999


def test_invalid_value_fails_at_start_up_naming_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_EXAMPLE_CAPACITY_GROUPS", "many")
    with pytest.raises(ConfigError) as failure:
        load_settings(ExampleSettings)
    assert "MILES_EXAMPLE_CAPACITY_GROUPS" in failure.value.message
    assert failure.value.field == "capacity_groups"


def test_unknown_override_is_refused() -> None:
    with pytest.raises(ConfigError, match="capacity_grops"):
        load_settings(ExampleSettings, capacity_grops=3)


def test_field_docstrings_become_descriptions() -> None:
    assert ExampleSettings.model_fields["capacity_groups"].description == "Groups held per job."
    assert ExampleSettings.model_fields["shutdown_grace_s"].description


class RangeSettings(ServiceSettings):
    model_config = service_config("RANGE")

    min_s: float = 1.0
    max_s: float = 2.0

    @model_validator(mode="after")
    def check_order(self) -> RangeSettings:
        if self.min_s > self.max_s:
            raise ValueError("min_s must not exceed max_s")
        return self


def test_model_level_validator_failure_is_a_readable_config_error() -> None:
    with pytest.raises(ConfigError, match="settings: Value error, min_s must not exceed max_s") as failure:
        load_settings(RangeSettings, min_s=5.0)
    assert failure.value.field is None


def test_config_file_provides_values_below_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "example.json"
    config.write_text(json.dumps({"capacity_groups": 7, "log_level": "DEBUG"}))
    monkeypatch.setenv("MILES_EXAMPLE_CONFIG_FILE", str(config))
    monkeypatch.setenv("MILES_EXAMPLE_LOG_LEVEL", "ERROR")
    settings = load_settings(ExampleSettings)
    assert settings.capacity_groups == 7
    assert settings.log_level == "ERROR"


def test_invalid_value_in_config_file_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "example.json"
    config.write_text(json.dumps({"capacity_groups": "many"}))
    monkeypatch.setenv("MILES_EXAMPLE_CONFIG_FILE", str(config))
    with pytest.raises(ConfigError, match="capacity_groups"):
        load_settings(ExampleSettings)


def test_missing_config_file_is_a_config_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MILES_EXAMPLE_CONFIG_FILE", str(tmp_path / "absent.json"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(ExampleSettings)
