"""The rollout section of a job spec and the worker's settings: what is accepted, what is refused, and that the
example job specs validate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from miles.common.errors import ConfigError
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.settings import load_settings
from miles.rollout.settings import RolloutSettings

REPO_ROOT = Path(__file__).resolve().parents[3]
MINIMAL: dict[str, Any] = {"dataset": {"path": "d.jsonl"}, "agent": {"function": "pkg.mod:agent"}}


@pytest.mark.parametrize("example", ["math_single_turn", "calculator_tool", "terminal_task", "solver_verifier"])
def test_example_job_specs_validate(example: str) -> None:
    section = yaml.safe_load((REPO_ROOT / "examples" / example / "job.yaml").read_text())["rollout"]
    spec = RolloutSpec.model_validate(section)
    assert (REPO_ROOT / spec.dataset.path).is_file()
    assert spec.agent.function.startswith(f"{example}.agent:")


def test_defaults_of_a_minimal_section() -> None:
    spec = RolloutSpec.model_validate(MINIMAL)
    assert spec.reward.type == "agent" and spec.n_samples_per_prompt == 8 and spec.sample_mode == "merge"
    assert spec.partial_rollout.policy == "keep_per_span"
    assert spec.concurrency.resolved_max_live_episodes == 48  # 32 engine slots x 1.5
    assert spec.resolved_session_ttl_s == spec.agent.timeout_s + 300


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"agent": {"function": "no_colon"}}, "agent.function"),
        ({"request_kwargs": {"logit_bias": {}}}, "request_kwargs"),
        ({"reward": {"type": "regex"}}, "reward.regex.pattern"),
        ({"reward": {"type": "telepathy"}}, "reward"),
        ({"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_sections_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        RolloutSpec.model_validate({**MINIMAL, **change})
    assert field in ".".join(str(part) for part in caught.value.errors()[0]["loc"]) or field in str(caught.value)


def test_filters_that_would_drop_every_group_are_refused() -> None:
    with pytest.raises(ValidationError, match="min_valid_samples"):
        RolloutSpec.model_validate({**MINIMAL, "n_samples_per_prompt": 2, "group_filters": {"min_valid_samples": 3}})


def test_settings_read_the_job_section_from_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "rollout.json"
    config.write_text(json.dumps({"job_id": "job-1", "rollout": MINIMAL}))
    monkeypatch.setenv("MILES_ROLLOUT_CONFIG_FILE", str(config))
    monkeypatch.setenv("MILES_ROLLOUT_WORKER_ID", "w-7")
    settings = load_settings(RolloutSettings)
    assert settings.job_id == "job-1" and settings.worker_id == "w-7"
    assert settings.rollout is not None and settings.rollout.agent.function == "pkg.mod:agent"


def test_a_job_without_its_section_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ROLLOUT_JOB_ID", "job-1")
    with pytest.raises(ConfigError, match="rollout section"):
        load_settings(RolloutSettings)


@pytest.mark.parametrize(
    ("example", "connector"),
    [
        ("reasoning_gym", "reasoning_gym"),
        ("verifiers_env", "verifiers"),
        ("openenv_env", "openenv"),
        ("harbor_tasks", "harbor"),
    ],
)
def test_environment_job_specs_validate(example: str, connector: str) -> None:
    section = yaml.safe_load((REPO_ROOT / "examples" / example / "job.yaml").read_text())["rollout"]
    spec = RolloutSpec.model_validate(section)
    assert spec.agent is None and spec.dataset.path is None
    assert spec.environment is not None and spec.environment.connector == connector
    assert spec.environment.env_name == connector.replace("_", "-")
    assert spec.resolved_session_ttl_s == spec.environment.timeout_s + 300


ENVIRONMENT: dict[str, Any] = {"environment": {"connector": "reasoning_gym", "args": {"dataset": "chain_sum"}}}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "exactly one of rollout.agent"),
        ({**MINIMAL, **ENVIRONMENT}, "exactly one of rollout.agent"),
        ({"agent": {"function": "pkg.mod:agent"}}, "dataset.path is required"),
        ({**ENVIRONMENT, "dataset": {"path": "d.jsonl"}}, "dataset.path must be absent"),
        ({**ENVIRONMENT, "reward": {"type": "exact_match"}}, "reward.type must be `agent`"),
        ({"environment": {"connector": "not a module"}}, "connector"),
        ({"environment": {"connector": "x", "timeout_s": 0}}, "timeout_s"),
    ],
)
def test_agent_or_environment_is_checked(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RolloutSpec.model_validate(section)


def test_a_custom_connector_keeps_its_module_name() -> None:
    spec = RolloutSpec.model_validate({"environment": {"connector": "my_envs.maze", "python_path": ["envs"]}})
    assert spec.environment is not None and spec.environment.env_name == "my_envs.maze"
