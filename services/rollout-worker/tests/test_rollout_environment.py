"""Hub environments, the worker's side: a real environment server (a subprocess running a test connector),
episodes through a real session server and engine. Its rows become the dataset; its rewards become the
samples'; a crash, a hang past the timeout, an error and a malformed reward each end the episode ABORTED with
its reason counted, the server is restarted, and later episodes succeed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from miles.common.jobspec.rollout import RolloutSpec
from miles.common.telemetry import Metrics
from miles.proto.common.v1 import common_pb2
from miles.rollout.episode import EpisodeRunner, EpisodeTask
from miles.rollout.episode_source import EpisodeSource, open_episode_source
from miles.rollout.errors import EnvironmentStartError
from miles.rollout.metrics import RolloutMetrics
from miles.rollout.rewards import Scorer
from miles.rollout.sessions import SessionClient
from miles.rollout.settings import RolloutSettings

pytestmark = pytest.mark.integration

JOB_ID = "environment-flow"
CONNECTORS_DIR = Path(__file__).parent / "env_connectors"
COMPLETED, TRUNCATED, ABORTED = (
    common_pb2.SAMPLE_STATUS_COMPLETED,
    common_pb2.SAMPLE_STATUS_TRUNCATED,
    common_pb2.SAMPLE_STATUS_ABORTED,
)
MODES = ["raise", "crash", "hang", "bad", "slow"]


def environment_spec(**environment: Any) -> RolloutSpec:
    section = {
        "connector": "misbehaving_connector",
        "python_path": [str(CONNECTORS_DIR)],
        "interpreter": sys.executable,  # the test connector needs only miles-envserver, installed in .venv too
        "args": {"num_ok": 3},
        "timeout_s": 30,
        **environment,
    }
    return RolloutSpec.model_validate(
        {"environment": section, "dataset": {"shuffle": False}, "request_kwargs": {"max_tokens": 6}}
    )


def settings() -> RolloutSettings:
    return RolloutSettings(
        environment_health_interval_s=0.2, environment_health_timeout_s=1.0, environment_failures_to_restart=2
    )


@pytest.fixture
async def sessions(services: Any) -> AsyncIterator[SessionClient]:
    client = SessionClient(
        services.session_url, operator_token=services.operator_token, request_timeout_s=30, retry_budget_s=5
    )
    yield client
    await client.close()


async def run(source: EpisodeSource, spec: RolloutSpec, runner: EpisodeRunner, index: int) -> Any:
    task = EpisodeTask(
        JOB_ID, f"{JOB_ID}/e0/p{index}", index, 0, index, 0, source.dataset.prompt(index), source.dataset.label(index)
    )
    return await runner.run(task)


def exported(runner: EpisodeRunner) -> str:
    return runner.metrics.registry.exposition().decode()


async def test_rows_rewards_and_every_failure_of_an_environment(services: Any, sessions: SessionClient) -> None:
    spec = environment_spec(timeout_s=4)
    metrics = RolloutMetrics(Metrics("rollout"))
    source = await open_episode_source(spec, settings(), metrics)
    try:
        runner = EpisodeRunner(
            spec,
            sessions=sessions,
            agent=source.agent,
            scorer=Scorer(spec.reward, job_id=JOB_ID, sandbox=None),
            metrics=metrics,
            worker_id="w-env",
        )
        assert len(source.dataset) == len(MODES) + 3
        assert source.dataset.prompt(0)["messages"] == [{"role": "user", "content": "Say raise."}]
        assert "environment=" in source.dataset.fingerprint

        ok = await run(source, spec, runner, len(MODES))
        (sample,) = ok.samples
        assert sample.status in (COMPLETED, TRUNCATED) and sample.reward == 1.0
        assert (
            sample.metadata["reward_info"]["num_chars"] > 0
            and sample.metadata["environment"] == "misbehaving_connector"
        )
        assert sum(sample.loss_mask) > 0, "the environment's model call was recorded by the session"

        expected = {
            "raise": ("environment_error", "the environment broke"),
            "bad": ("bad_reward", "reward must be a finite number"),
            "slow": ("timeout", "timeout of 4 s"),
            "crash": ("environment_error", "lost mid-episode"),
            "hang": (None, None),  # the watchdog's restart (environment_error) or the timeout, whichever is first
        }
        for mode, (reason, text) in expected.items():
            outcome = await run(source, spec, runner, MODES.index(mode))
            assert outcome.status == ABORTED, mode
            assert outcome.samples[0].reward == 0.0
            if reason is None:
                assert outcome.reason in ("environment_error", "timeout"), outcome.reason
            else:
                assert outcome.reason == reason, (mode, outcome.samples[0].metadata.get("error"))
                assert text in outcome.samples[0].metadata["error"], outcome.samples[0].metadata["error"]
            after = await run(source, spec, runner, len(MODES) + 1)  # waits for a restarted server
            assert after.samples[0].reward == 1.0, (mode, after.reason)

        text = exported(runner)
        assert 'miles_rollout_environment_restarts_total{cause="exited"} 1.0' in text
        assert 'miles_rollout_environment_restarts_total{cause="unresponsive"} 1.0' in text
        for reason in ("environment_error", "bad_reward", "timeout"):
            assert f'miles_rollout_episodes_total{{reason="{reason}",status="ABORTED"}}' in text
        assert source.environment is not None and not source.environment.failed.is_set()
    finally:
        await runner.drain()
        await source.close()


async def test_an_environment_that_cannot_start_is_a_config_error_with_its_output() -> None:
    metrics = RolloutMetrics(Metrics("rollout"))
    with pytest.raises(EnvironmentStartError, match="no_such_module"):
        await open_episode_source(environment_spec(connector="no_such_module"), settings(), metrics)
    missing = environment_spec(connector="verifiers", interpreter="")
    with pytest.raises(EnvironmentStartError, match="make env-verifiers"):
        await open_episode_source(missing, settings().model_copy(update={"envs_dir": "/nonexistent"}), metrics)


async def test_a_source_closes_its_server_process() -> None:
    source = await open_episode_source(environment_spec(), settings(), RolloutMetrics(Metrics("rollout")))
    server = source.environment
    assert server is not None and await server.healthy()
    await source.close()
    process = getattr(server, "process", None)
    assert process is not None and process.returncode is not None
    await asyncio.sleep(0)
