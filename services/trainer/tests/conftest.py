"""Shared fixtures of the trainer tests: models built by the project's own tiny-model builder, group builders,
rollouts of the tiny MoE model by a real in-process engine (routed experts on), real `miles-buffer` and
`miles-trainer` subprocesses, and a gRPC client for the trainer's control API."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from miles.common.auth import bearer_metadata
from miles.common.contracts.routing import RoutingShape, decode_sglang, pack
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.model import load_model, sequence_logprobs
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from miles.trainer.batch import TrainSample

COMPLETED = common_pb2.SAMPLE_STATUS_COMPLETED
SMALL_VOCAB = 512
SMALL_OVERRIDES = {"vocab_size": SMALL_VOCAB, "num_hidden_layers": 2, "max_window_layers": 2}
TEACHER_SFT_STEPS = 20
TEACHER_SFT_LR = 1e-3


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen3 model (151,936-token vocabulary, 4 layers), built by our own builder."""
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's architecture with a 512-token vocabulary and 2 layers: the same code paths at a
    fraction of the cost (the full vocabulary's LM head dominates a CPU step), for the many-step tests."""
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "small-qwen3", config_overrides=SMALL_OVERRIDES)


def _train_toward_the_toy_targets(model: Any, _: Path) -> None:
    """TEACHER_SFT_STEPS AdamW steps of cross-entropy on responses of 8 random ids below the toy task's
    `target_below` after 4 random prompt ids (16 sequences a step, fixed seed)."""
    from miles.trainer.toy_task import ToyTask

    task, rng = ToyTask(), random.Random(123)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TEACHER_SFT_LR)
    model.train()
    for _ in range(TEACHER_SFT_STEPS):
        loss = torch.zeros(())
        for _ in range(16):
            prompt = [rng.randrange(SMALL_VOCAB) for _ in range(task.prompt_tokens)]
            response = [rng.randrange(task.target_below) for _ in range(task.response_tokens)]
            tokens = torch.tensor(prompt + response)
            hidden = model(tokens)[task.prompt_tokens - 1 : -1]
            logits = torch.nn.functional.linear(hidden, model.lm_head_weight)
            loss = loss + torch.nn.functional.cross_entropy(logits, tokens[task.prompt_tokens :]) / 16
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="session")
def small_teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small model trained longer: the same initial weights (seed 0) after TEACHER_SFT_STEPS supervised steps
    toward the toy task's target ids. A different policy the student can reach: the student's samples have a
    per-token reverse KL of ~0.67 to it, and it puts ~22 % of its mass on the target ids (the student 12 %)."""
    from miles.engine.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "small-qwen3-teacher"
    return build_tiny_model(out, config_overrides=SMALL_OVERRIDES, warmup=_train_toward_the_toy_targets)


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE model (4 sparse layers, 8 experts, top-2; the real vocabulary), built by our builder."""
    from miles.engine.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", moe=True)


TINY_MOE_ROUTING = RoutingShape(num_layers=4, top_k=2, num_experts=8)


def generate_moe_rollouts(
    model_dir: Path, *, num_prompts: int, samples_per_prompt: int = 2, seed: int = 0, max_new_tokens: int = 8
) -> list[tuple[list[int], list[dict[str, Any]]]]:
    """(prompt, replies) per prompt, all generated concurrently by one in-process `miles.engine` (deterministic,
    `enable_return_routed_experts`) at temperature 1: each reply has `output_ids`, `meta_info.routed_experts`
    (SGLang's base64 int32 rows) and `meta_info.output_token_logprobs`."""
    from miles.common.telemetry import Metrics
    from miles.engine.main import build_engine
    from miles.engine.protocol import GenerateRequest
    from miles.engine.settings import EngineSettings

    settings = EngineSettings(model_path=model_dir, deterministic=True, enable_return_routed_experts=True)
    engine, _ = build_engine(settings, Metrics("engine"))
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 150000) for _ in range(rng.randrange(3, 12))] for _ in range(num_prompts)]

    async def generate_all() -> list[Any]:
        requests = []
        for index, prompt in enumerate(prompts):
            for choice in range(samples_per_prompt):
                sampling_seed = seed * 1000 + index * samples_per_prompt + choice
                sampling = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "sampling_seed": sampling_seed}
                body = GenerateRequest(
                    input_ids=prompt, sampling_params=sampling, return_logprob=True, return_routed_experts=True
                )
                requests.append(engine.generate(engine.plan(body)))
        return await asyncio.gather(*requests)

    try:
        replies = asyncio.run(generate_all())
    finally:
        engine.scheduler.stop()
    return [
        (prompt, replies[index * samples_per_prompt : (index + 1) * samples_per_prompt])
        for index, prompt in enumerate(prompts)
    ]


def moe_group(
    group_id: str,
    prompt: list[int],
    replies: Sequence[dict[str, Any]],
    *,
    version: int = 0,
    routing: RoutingShape | None = TINY_MOE_ROUTING,
) -> common_pb2.Group:
    """A group of engine replies as the session server builds it: tokens, logprobs, one span, rewards 0, 1, ...
    and (unless `routing` is None) the routing packed as `Sample.rollout_routed_experts`."""
    group = common_pb2.Group(group_id=group_id)
    for index, reply in enumerate(replies):
        output_ids = list(reply["output_ids"])
        sample = group.samples.add(
            sample_id=f"{group_id}/{index}",
            group_id=group_id,
            tokens=prompt + output_ids,
            response_start=len(prompt),
            loss_mask=[1] * len(output_ids),
            rollout_logprobs=[entry[0] for entry in reply["meta_info"]["output_token_logprobs"]],
            reward=float(index % 2),
            status=COMPLETED,
        )
        sample.weight_versions.add(start=0, end=len(output_ids), weight_version=version)
        if routing is not None:
            sample.rollout_routed_experts.CopyFrom(pack(decode_sglang(reply["meta_info"]["routed_experts"]), routing))
    return group


def build_group(
    group_id: str,
    *,
    num_samples: int = 2,
    num_prompt_tokens: int = 4,
    num_response_tokens: int = 4,
    rewards: Sequence[float] | None = None,
    version: int = 0,
    seed: int = 0,
    vocab_size: int = SMALL_VOCAB,
    rollout_logprob: float = -5.0,
    prompt_index: int = 0,
) -> common_pb2.Group:
    """A valid group whose samples have deterministic pseudo-random tokens below vocab_size."""
    group = common_pb2.Group(group_id=group_id, prompt_index=prompt_index)
    num_tokens = num_prompt_tokens + num_response_tokens
    for index in range(num_samples):
        base = (seed * 7919 + index * 104729 + sum(map(ord, group_id)) * 31) % vocab_size
        sample = group.samples.add(
            sample_id=f"{group_id}/{index}",
            group_id=group_id,
            episode_id=f"{group_id}/e{index}",
            tokens=[(base + 37 * position) % vocab_size for position in range(num_tokens)],
            response_start=num_prompt_tokens,
            loss_mask=[1] * num_response_tokens,
            rollout_logprobs=[rollout_logprob] * num_response_tokens,
            reward=float(rewards[index]) if rewards is not None else float(index % 2),
            status=COMPLETED,
        )
        sample.weight_versions.add(start=0, end=num_response_tokens, weight_version=version)
    return group


def build_step_groups(
    model_dir: Path, *, deterministic: bool, num_groups: int = 2, per_group: int = 3
) -> list[list[TrainSample]]:
    """Groups of random sequences (for in-process steps) whose rollout logprobs are the model's own
    (deterministic or fast); rewards 0/1 at random (with the defaults both groups have reward variance)."""
    model = load_model(model_dir)
    rng = random.Random(7)
    groups = []
    for g in range(num_groups):
        group = []
        for i in range(per_group):
            length, prompt = rng.randrange(6, 14), rng.randrange(2, 5)
            tokens = [rng.randrange(0, 512) for _ in range(length)]
            with torch.no_grad():
                logprobs = sequence_logprobs(model, torch.tensor(tokens), start=prompt, deterministic=deterministic)
            mask = [1] * (length - prompt)
            mask[0] = 0  # a tool token in the middle of the response: not trained on
            group.append(
                TrainSample(
                    f"g{g}",
                    f"g{g}/{i}",
                    g,
                    tokens,
                    prompt,
                    mask,
                    logprobs.tolist(),
                    float(rng.random() < 0.5),
                    True,
                    0,
                    0,
                )
            )
        groups.append(group)
    return groups


@dataclass
class BufferProcess:
    """A real miles-buffer subprocess over a given Redis."""

    redis_url: str
    log_dir: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: ServiceProcess | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> BufferProcess:
        env = {
            "MILES_BUFFER_REDIS_URL": self.redis_url,
            "MILES_BUFFER_PORT": str(self.port),
            "MILES_BUFFER_METRICS_PORT": str(self.metrics_port),
            "MILES_BUFFER_LEASE_REAP_INTERVAL_S": "0.2",
            "MILES_BUFFER_POLL_INTERVAL_S": "0.05",
        }
        self.process = ServiceProcess(
            [console_script("miles-buffer")],
            ready_url=f"http://127.0.0.1:{self.metrics_port}/readyz",
            env=env,
            log_path=self.log_dir / "miles-buffer.log",
        ).start()
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


@pytest.fixture
def buffer_process(redis_url: str, tmp_path: Path) -> Iterator[BufferProcess]:
    process = BufferProcess(redis_url, tmp_path / "buffer").start()
    yield process
    process.stop()


@dataclass
class TrainerProcess:
    """A real miles-trainer subprocess (restartable on the same ports, for crash tests); its control API calls
    carry `auth_token` (the trainer's MILES_TRAINER_AUTH_TOKEN, "" = none)."""

    env: dict[str, str]
    log_dir: Path
    argv: list[str] = field(default_factory=lambda: [console_script("miles-trainer")])
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: ServiceProcess | None = None
    starts: int = 0
    auth_token: str = ""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.auth_token)

    def start(self) -> TrainerProcess:
        env = {
            **self.env,
            "MILES_TRAINER_PORT": str(self.port),
            "MILES_TRAINER_METRICS_PORT": str(self.metrics_port),
        }
        self.starts += 1
        self.process = ServiceProcess(
            self.argv,
            ready_url=f"http://127.0.0.1:{self.metrics_port}/readyz",
            env=env,
            log_path=self.log_dir / f"miles-trainer-{self.starts}.log",
        ).start(ready_timeout_s=180.0)
        return self

    def status(self, timeout_s: float = 10.0) -> trainer_pb2.StatusResponse:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
            response: trainer_pb2.StatusResponse = stub.Status(
                trainer_pb2.StatusRequest(), timeout=timeout_s, metadata=self.metadata
            )
            return response

    def call(self, method: str, request: Any, timeout_s: float = 300.0) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
            return getattr(stub, method)(request, timeout=timeout_s, metadata=self.metadata)

    def wait_for(
        self, predicate: Callable[[trainer_pb2.StatusResponse], bool], timeout_s: float = 600.0
    ) -> trainer_pb2.StatusResponse:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None and self.process.is_running(), self.log_tail()
            status = self.status()
            if predicate(status):
                return status
            assert status.state != trainer_pb2.TRAINER_STATE_FAILED, status.error
            assert time.monotonic() < deadline, f"timed out; last status {status}"
            time.sleep(0.1)

    def log_tail(self) -> str:
        return self.process.log_tail() if self.process is not None else ""

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill9()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def trainer_env(
    *,
    job_id: str,
    buffer: BufferProcess,
    model_dir: Path,
    checkpoint_dir: Path,
    **train: Any,
) -> dict[str, str]:
    """Environment of a miles-trainer for a test job; `train` entries become MILES_TRAINER_TRAIN__<KEY>. Versions
    are published to `<checkpoint_dir>/published/weights-v.../` in float32 (the `disk` publisher, no engines
    unless a test adds some), so tests can load exactly what the trainer trained."""
    env = {
        "MILES_TRAINER_JOB_ID": job_id,
        "MILES_TRAINER_PUBLISH__KIND": "disk",
        "MILES_TRAINER_PUBLISH__DTYPE": "float32",
        "MILES_TRAINER_BUFFER_ADDRESS": buffer.target,
        "MILES_TRAINER_MODEL_PATH": str(model_dir),
        "MILES_TRAINER_CHECKPOINT_DIR": str(checkpoint_dir),
        "MILES_TRAINER_NUM_THREADS": "1",
        "MILES_TRAINER_LOG_LEVEL": "INFO",
    }
    for key, value in train.items():
        env[f"MILES_TRAINER_TRAIN__{key.upper()}"] = str(value)
    return env


GroupFactory = Callable[..., common_pb2.Group]
EnvFactory = Callable[..., dict[str, str]]
TrainerFactory = Callable[[dict[str, str]], TrainerProcess]


@pytest.fixture
def make_group() -> GroupFactory:
    return build_group


@pytest.fixture(scope="session")
def moe_rollouts() -> Callable[..., list[tuple[list[int], list[dict[str, Any]]]]]:
    """`generate_moe_rollouts`: engine rollouts of the tiny MoE model with their routing."""
    return generate_moe_rollouts


@pytest.fixture(scope="session")
def make_moe_group() -> Callable[..., common_pb2.Group]:
    """`moe_group`: engine replies as a buffer group with packed routing."""
    return moe_group


@pytest.fixture
def make_step_groups() -> Callable[..., list[list[TrainSample]]]:
    return build_step_groups


@pytest.fixture
def make_trainer_env() -> EnvFactory:
    return trainer_env


@pytest.fixture
def start_trainer(tmp_path: Path) -> Iterator[TrainerFactory]:
    """Starts miles-trainer subprocesses (not yet started: call .start()); stops them all after the test."""
    created: list[TrainerProcess] = []

    def create(env: dict[str, str]) -> TrainerProcess:
        process = TrainerProcess(env, tmp_path / f"trainer-{len(created)}")
        created.append(process)
        return process

    yield create
    for process in created:
        process.stop()


@pytest.fixture
def job_id(request: pytest.FixtureRequest) -> str:
    return "job-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:100] + f"-{os.getpid()}"
