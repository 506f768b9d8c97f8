"""Shared fixtures of the rollout-worker tests: a Qwen3 model directory, real service subprocesses (a
`miles-engine --fake-model`, a `miles-session-server` in front of it, a `miles-buffer`) over the test
session's Redis, and factories for specs and samples.

Tests run with --import-mode=importlib, so helpers are handed out as fixtures rather than imported.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from miles.common.jobspec.rollout import RolloutSpec
from miles.common.testing import RedisServer, ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.proto.common.v1 import common_pb2

OPERATOR_TOKEN = "rollout-tests-operator-" + "x" * 32
QWEN3_EOS_ID = 151645
WORKER_TESTS_REDIS_DB = 11


def _qwen3_model_dir(folder: Path) -> Path:
    """The real Qwen3 tokenizer files (with its chat template) and a config.json: enough for the session server
    and `miles-engine --fake-model`."""
    from miles.session.tito.assets import bundled_tokenizer_dir

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(bundled_tokenizer_dir("qwen3") / name, folder / name)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "eos_token_id": QWEN3_EOS_ID,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _qwen3_model_dir(tmp_path_factory.mktemp("models") / "qwen3")


@pytest.fixture(scope="module")
def module_redis_url(redis_server: RedisServer) -> str:
    """A database of the session's Redis for this module (other tests flush DB 0), flushed at module start."""
    url = redis_server.url.rsplit("/", 1)[0] + f"/{WORKER_TESTS_REDIS_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


def _start(name: str, argv: list[str], env: dict[str, str], ready_url: str, log_dir: Path) -> ServiceProcess:
    return ServiceProcess(argv, ready_url=ready_url, env=env, log_path=log_dir / f"{name}.log").start(120.0)


@dataclass
class Services:
    """Real subprocesses for one test module."""

    engine_url: str
    session_url: str
    buffer_address: str
    redis_url: str
    operator_token: str
    processes: list[ServiceProcess]

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@pytest.fixture(scope="module")
def services(
    module_redis_url: str, qwen3_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Services]:
    """A fake-model engine, a session server upstream of it (Qwen3 by default), and a buffer."""
    log_dir = tmp_path_factory.mktemp("services")
    engine_port, session_port, buffer_port, buffer_metrics = free_port(), free_port(), free_port(), free_port()
    processes: list[ServiceProcess] = []
    try:
        argv = [console_script("miles-engine"), "--model-path", str(qwen3_model_dir), "--fake-model"]
        engine_url = f"http://127.0.0.1:{engine_port}"
        processes.append(_start("engine", [*argv, "--port", str(engine_port)], {}, f"{engine_url}/readyz", log_dir))
        session_url = f"http://127.0.0.1:{session_port}"
        session_env = {
            "MILES_SESSION_PORT": str(session_port),
            "MILES_SESSION_REDIS_URL": module_redis_url,
            "MILES_SESSION_UPSTREAM_URL": engine_url,
            "MILES_SESSION_OPERATOR_TOKEN": OPERATOR_TOKEN,
            "MILES_SESSION_DEFAULT_MODEL_PATH": str(qwen3_model_dir),
            "MILES_SESSION_DEFAULT_MODEL_FAMILY": "qwen3",
            "MILES_SESSION_LOG_JSON": "false",
        }
        processes.append(
            _start("session", [console_script("miles-session-server")], session_env, f"{session_url}/readyz", log_dir)
        )
        buffer_env = {
            "MILES_BUFFER_REDIS_URL": module_redis_url,
            "MILES_BUFFER_PORT": str(buffer_port),
            "MILES_BUFFER_METRICS_PORT": str(buffer_metrics),
            "MILES_BUFFER_POLL_INTERVAL_S": "0.05",
            "MILES_BUFFER_LOG_JSON": "false",
        }
        buffer_ready = f"http://127.0.0.1:{buffer_metrics}/readyz"
        processes.append(_start("buffer", [console_script("miles-buffer")], buffer_env, buffer_ready, log_dir))
    except BaseException:
        for process in processes:
            process.stop()
        raise
    running = Services(engine_url, session_url, f"127.0.0.1:{buffer_port}", module_redis_url, OPERATOR_TOKEN, processes)
    yield running
    running.stop()


@pytest.fixture
def make_spec(tmp_path: Path) -> Callable[..., RolloutSpec]:
    """make_spec(num_prompts=4, **section overrides) -> a RolloutSpec over a fresh JSONL dataset."""

    def make(num_prompts: int = 4, **overrides: Any) -> RolloutSpec:
        path = tmp_path / f"data-{num_prompts}.jsonl"
        rows = [{"prompt": f"Count to {i}.", "label": str(i)} for i in range(num_prompts)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        section: dict[str, Any] = {
            "dataset": {"path": str(path), "num_epochs": 1},
            "agent": {"function": "tests_agents:unused"},
            "n_samples_per_prompt": 2,
        }
        section.update(overrides)
        return RolloutSpec.model_validate(section)

    return make


def build_sample(
    *,
    num_prompt: int = 4,
    turns: tuple[int, ...] = (3,),
    gap: int = 2,
    versions: tuple[int, ...] | None = None,
    status: int = common_pb2.SAMPLE_STATUS_COMPLETED,
    reward: float = 0.0,
) -> common_pb2.Sample:
    """A merged sample like the session server's: turns of sampled tokens separated by `gap` injected tokens."""
    sample = common_pb2.Sample(
        sample_id="s", group_id="g", episode_id="e", response_start=num_prompt, status=status, reward=reward
    )
    sample.tokens.extend(range(100, 100 + num_prompt))
    versions = versions or tuple(0 for _ in turns)
    for index, (num_tokens, version) in enumerate(zip(turns, versions, strict=True)):
        if index:
            sample.tokens.extend([7] * gap)
            sample.loss_mask.extend([0] * gap)
            sample.rollout_logprobs.extend([0.0] * gap)
        start = len(sample.loss_mask)
        sample.tokens.extend([5] * num_tokens)
        sample.loss_mask.extend([1] * num_tokens)
        sample.rollout_logprobs.extend([-0.5] * num_tokens)
        sample.weight_versions.add(start=start, end=start + num_tokens, weight_version=version)
    return sample


@pytest.fixture
def make_sample() -> Callable[..., common_pb2.Sample]:
    return build_sample
