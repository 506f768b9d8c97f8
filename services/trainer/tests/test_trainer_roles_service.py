"""Groups of multi-agent episodes through a real miles-trainer, miles-buffer and Redis: a group whose rewards differ
only across roles has no signal (dynamic sampling discards it), and the per-role figures of a step reach every
place the trainer reports its step metrics: the step event, `Status.last_step_metrics` (what the controller's
backends read into the job's progress events) and /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from miles.buffer.client import BufferClient
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.integration


def _role_group(make_group: Any, group_id: str, rewards: Sequence[float], seed: int) -> common_pb2.Group:
    """Samples alternately of the roles solver and verifier (metadata["role"])."""
    group: common_pb2.Group = make_group(group_id, num_samples=len(rewards), rewards=rewards, seed=seed)
    for index, sample in enumerate(group.samples):
        sample.metadata.update({"role": "solver" if index % 2 == 0 else "verifier"})
    return group


def _metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def _step_event(port: int) -> trainer_pb2.TrainerEvent:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)  # type: ignore[no-untyped-call]
        event: trainer_pb2.TrainerEvent
        for event in stub.WatchEvents(trainer_pb2.WatchEventsRequest(from_step=0), timeout=30):
            if event.kind == "step":
                return event
    raise AssertionError("no step event")


async def test_per_role_baselines_and_metrics_in_a_real_trainer(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    groups = [
        _role_group(make_group, "across-roles-only", [1.0, 0.0, 1.0, 0.0], seed=0),  # solver 1, 1; verifier 0, 0
        _role_group(make_group, "a", [1.0, 10.0, 0.0, 30.0], seed=1),
        _role_group(make_group, "b", [0.0, 20.0, 1.0, 20.0], seed=2),
    ]
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
        for group in groups:
            await buffer.push_group(job_id, group)
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=tmp_path / "ckpt",
        batch_size_groups=2,
        num_steps=1,
        pull_wait_s=0.5,
    )
    trainer = start_trainer(env).start()
    status = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)

    assert (status.step, status.groups_trained, status.groups_rejected) == (1, 2, 0)
    expected = {
        "reward_mean/role=solver": 0.5,
        "num_samples/role=solver": 4.0,
        "reward_mean/role=verifier": 20.0,
        "num_trainable_samples/role=verifier": 4.0,
    }
    assert {name: status.last_step_metrics[name] for name in expected} == expected
    step = _step_event(trainer.port)
    assert {name: step.metrics[name] for name in expected} == expected
    text = _metrics_text(trainer.metrics_port)
    assert "miles_trainer_groups_zero_signal_total 1.0" in text
    assert 'miles_trainer_role_reward_mean{role="verifier"} 20.0' in text
    assert 'miles_trainer_role_num_samples{role="solver"} 4.0' in text
