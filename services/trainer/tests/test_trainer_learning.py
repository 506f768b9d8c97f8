"""GRPO learns: a toy verifiable task (reward = fraction of response tokens with id < 64, out of a 512-token
vocabulary: a random policy scores ~0.125) on the small-vocabulary tiny model, through the real services. The
test samples rollouts in process from the weights the real `miles-trainer` publishes (sync mode: version k's
data trains step k+1), pushes them to a real `miles-buffer`, and the trainer steps on them. The recipe is the
default one (dynamic sampling on) but for lr 1e-2: a group whose 8 rewards are all equal is discarded by the
trainer, and the test pushes more groups of the same version until the batch is full. Once the policy has
solved the task (256 groups sampled from one version hold fewer than 4 with reward variance) no batch can be
filled any more: the test stops the trainer there.

Runs for seeds 0, 1 and 2 (rollouts, prompts, the trainer's seed; each group sampled with its own seed, so a run
is deterministic); asserts that the last three versions average at least 0.5 and at least 0.3 above the first
two. Measured on the 2-core CI machine (4 groups x 8 samples x 8 response tokens per step); with
MILES_WRITE_BENCH_RESULTS=1 each seed's curve is written to bench/results/trainer_learning_seeds.json:

    seed  first two versions  last three versions  steps  groups pulled  runtime (in the trainer suite)
    0     0.174               0.984                10     378            18.8 s   (solved at version 10)
    1     0.109               0.651                12      49             6.6 s
    2     0.102               0.968                12     145            10.5 s
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.buffer.client import BufferClient
from miles.common.testing.machine import describe_machine
from miles.model import CausalLM, load_model, load_named_tensors, read_safetensors_dir
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.toy_task import ToyTask, mean_reward, sample_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_STEPS = 12
GROUPS_PER_STEP = 4
LR = 1e-2
SOLVED_AFTER_GROUPS = 256
RESULTS_PATH = Path(__file__).resolve().parents[3] / "bench" / "results" / "trainer_learning_seeds.json"


def _zero_signal_total(metrics_port: int) -> int:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("miles_trainer_groups_zero_signal_total "))
    return int(float(line.split()[1]))


class _Sampler:
    """Rollouts from the policy the trainer last published. Group k of a version is sampled with its own seed
    (seed, version, k), so what the trainer sees does not depend on how many spare groups timing made us
    sample before it: the run is deterministic."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        self.policy: CausalLM = load_model(model_dir)
        self.task = ToyTask()
        self.seed = seed

    def group(self, version: int, index: int) -> common_pb2.Group:
        group_seed = (self.seed * 1000 + version) * 1000 + index
        rng, generator = random.Random(group_seed), torch.Generator().manual_seed(group_seed)
        group_id = f"v{version}-g{index}"
        return sample_group(self.policy, self.task, group_id=group_id, version=version, rng=rng, generator=generator)


def _num_informative(groups: list[common_pb2.Group]) -> int:
    return sum(len({sample.reward for sample in group.samples}) > 1 for group in groups)


def _consumed(groups: list[common_pb2.Group]) -> list[common_pb2.Group]:
    """The groups the trainer pulled for its step, in push order: up to and including the GROUPS_PER_STEP-th
    with reward variance (the ones before it without variance were discarded)."""
    for end in range(len(groups) + 1):
        if _num_informative(groups[:end]) == GROUPS_PER_STEP:
            return groups[:end]
    raise AssertionError("the trainer stepped without GROUPS_PER_STEP informative groups")


@dataclass(frozen=True)
class VersionOutcome:
    """What one version's rollouts became: the groups the trainer pulled for its step (or, when the policy has
    solved the task, every group sampled), and how many the trainer discarded as zero-signal meanwhile."""

    groups: list[common_pb2.Group]
    num_discarded: int
    solved: bool


async def _train_version(
    buffer: BufferClient, job_id: str, trainer: Any, sampler: _Sampler, version: int, published: Path
) -> VersionOutcome:
    """Push GROUPS_PER_STEP groups of `version`, and two more for each the trainer discards as zero-signal (so
    that near convergence, where most groups are, the buffer stays ahead of the trainer instead of answering
    one discard at a time), until it publishes the next version. Spare groups left over are dropped by the
    buffer as stale once the trainer moves on. When SOLVED_AFTER_GROUPS groups hold fewer than GROUPS_PER_STEP
    with reward variance, the policy has solved the task: dynamic sampling cannot fill another batch."""
    discarded_before = await asyncio.to_thread(_zero_signal_total, trainer.metrics_port)
    groups: list[common_pb2.Group] = []
    solved = False
    while not solved and not (published / "model.safetensors").is_file():
        assert trainer.process.is_running(), trainer.log_tail()
        discarded = await asyncio.to_thread(_zero_signal_total, trainer.metrics_port) - discarded_before
        while len(groups) < min(GROUPS_PER_STEP + 2 * discarded, SOLVED_AFTER_GROUPS):
            groups.append(sampler.group(version, len(groups)))
            await buffer.push_group(job_id, groups[-1])
        solved = len(groups) == SOLVED_AFTER_GROUPS and _num_informative(groups) < GROUPS_PER_STEP
        await asyncio.sleep(0.05)
    discarded = await asyncio.to_thread(_zero_signal_total, trainer.metrics_port) - discarded_before
    return VersionOutcome(groups if solved else _consumed(groups), discarded, solved)


def _write_bench_result(seed: int, result: dict[str, Any]) -> None:
    existing = json.loads(RESULTS_PATH.read_text()) if RESULTS_PATH.is_file() else {}
    existing.setdefault("benchmark", "services/trainer/tests/test_trainer_learning.py, one entry per seed")
    existing.setdefault("seeds", {})[str(seed)] = result | {"machine": describe_machine()}
    RESULTS_PATH.write_text(json.dumps(existing, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_grpo_raises_the_mean_reward_of_a_verifiable_toy_task(
    seed: int,
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    started = time.perf_counter()
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
        seed=seed,
    )
    env["MILES_TRAINER_TRAIN__OPTIMIZER__LR"] = str(LR)
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
    trainer = start_trainer(env).start()
    sampler = _Sampler(small_model_dir, seed)
    rewards, num_groups, num_trained = [], [], 0
    async with BufferClient(buffer_process.target) as buffer:
        for version in range(NUM_STEPS):
            if version > 0:
                weights = read_safetensors_dir(tmp_path / "ckpt" / "published" / f"weights-v{version:06d}")
                load_named_tensors(sampler.policy, weights, require_all=True)
            published = tmp_path / "ckpt" / "published" / f"weights-v{version + 1:06d}"
            outcome = await _train_version(buffer, job_id, trainer, sampler, version, published)
            rewards.append(mean_reward(outcome.groups))
            num_groups.append(len(outcome.groups))
            if outcome.solved:
                assert rewards[-1] >= 0.95, f"no informative groups, yet a mean reward of {rewards[-1]}"
                break
            num_trained += 1
            # the trainer discarded exactly the groups without reward variance it pulled before its batch was full
            assert outcome.num_discarded == len(outcome.groups) - GROUPS_PER_STEP
    if num_trained == NUM_STEPS:
        final = trainer.wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    else:
        trainer.call("Stop", trainer_pb2.StopRequest(checkpoint=False))
        final = trainer.status()
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    runtime_s = time.perf_counter() - started
    print(
        f"seed {seed}: mean reward by version {[round(r, 3) for r in rewards]}, groups pulled {num_groups}, "
        f"steps {num_trained}, {runtime_s:.1f} s"
    )
    if os.environ.get("MILES_WRITE_BENCH_RESULTS") == "1":
        result = {
            "mean_reward_by_version": [round(r, 4) for r in rewards],
            "first2_mean": round(first, 4),
            "last3_mean": round(last, 4),
            "groups_pulled_by_version": num_groups,
            "num_steps_trained": num_trained,
            "runtime_s": round(runtime_s, 1),
            "recipe": {"mode": "sync", "batch_size_groups": GROUPS_PER_STEP, "lr": LR, "num_steps": NUM_STEPS},
            "cpu_count": os.cpu_count(),
        }
        _write_bench_result(seed, result)

    assert (final.step, final.weight_version) == (num_trained, num_trained)
    assert last >= 0.5 and last >= first + 0.3, rewards
