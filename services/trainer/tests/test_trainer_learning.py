"""GRPO learns: a toy verifiable task (reward = fraction of response tokens with id < 64, out of a 512-token
vocabulary: a random policy scores ~0.125) on the small-vocabulary tiny model, through the real services. The
test samples rollouts in process from the weights the real `miles-trainer` publishes (sync mode: version k's
data trains step k+1), pushes them to a real `miles-buffer`, and the trainer steps on them.

Measured on the 2-core CI machine (seeded; 4 groups x 8 samples x 8 response tokens per step, lr 1e-2):
mean reward by version 0.125, 0.164, 0.180, 0.156, 0.301, 0.262, 0.441, 0.402, 0.734, 0.758, 0.984, 0.984
(see bench/results/trainer.json from `make bench-trainer`); the test asserts the last three versions average
at least 0.5 and at least 0.3 above the first two.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.buffer.client import BufferClient
from miles.model import load_model, load_named_tensors, read_safetensors_dir
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.toy_task import ToyTask, mean_reward, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STEPS = 12
GROUPS_PER_STEP = 4


def _wait_for_published(directory: Path, trainer: Any, timeout_s: float = 600.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (directory / "model.safetensors").is_file():
        assert trainer.process.is_running(), trainer.log_tail()
        assert time.monotonic() < deadline, f"{directory} never appeared"
        time.sleep(0.05)
    return directory


async def test_grpo_raises_the_mean_reward_of_a_verifiable_toy_task(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    env = make_trainer_env(
        job_id=job_id,
        buffer=buffer_process,
        model_dir=small_model_dir,
        checkpoint_dir=tmp_path / "ckpt",
        mode="sync",
        batch_size_groups=GROUPS_PER_STEP,
        num_steps=NUM_STEPS,
        checkpoint_interval_steps=6,
        pull_wait_s=0.5,
    )
    env["MILES_TRAINER_TRAIN__OPTIMIZER__LR"] = "1e-2"
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
    trainer = start_trainer(env).start()
    task = ToyTask()
    policy = load_model(small_model_dir)
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    rewards = []
    async with BufferClient(buffer_process.target) as buffer:
        for version in range(NUM_STEPS):
            if version > 0:
                directory = tmp_path / "ckpt" / "published" / f"weights-v{version:06d}"
                published = await asyncio.to_thread(_wait_for_published, directory, trainer)
                load_named_tensors(policy, read_safetensors_dir(published), require_all=True)
            groups = [
                sample_group(policy, task, group_id=f"v{version}-g{i}", version=version, rng=rng, generator=generator)
                for i in range(GROUPS_PER_STEP)
            ]
            rewards.append(mean_reward(groups))
            for group in groups:
                await buffer.push_group(job_id, group)
    final = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    print("mean reward by version:", [round(r, 3) for r in rewards])

    assert (final.step, final.weight_version) == (NUM_STEPS, NUM_STEPS)
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last >= 0.5 and last >= first + 0.3, rewards
