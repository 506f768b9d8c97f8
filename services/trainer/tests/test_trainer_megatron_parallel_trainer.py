"""The Megatron backend at PP = 2 through the trainer's own launch path: `miles-trainer` under
`torch.distributed.run --nproc_per_node 2` (gloo), settings from the environment (`backend: megatron`,
`megatron.pp_size: 2`), each rank building its stage from the checkpoint directory, rank 0 pulling from a real
buffer and driving rank 1. It trains one step, is stopped, restarts from its checkpoint (weights and AdamW moments
gathered to rank 0 at the checkpoint, scattered back to both stages at the restart) and trains the second; the
final checkpoint equals a single-process Megatron computation of the same two steps. With PP = 2 both ranks are
one data rank, so the plan must give rank 0 the whole batch (core.py plans over `runner.data.size`). The recipe
runs every pipeline pass the trainer has: the scoring pass, the KL reference pass and the 1F1B training pass.

A second test resumes a DP = 2 Megatron checkpoint at one rank (its docstring says what is compared)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.buffer.client import BufferClient
from miles.common.jobspec.trainer import TrainConfig
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.model import ModelConfig, load_model, read_safetensors_dir, sequence_logprobs
from miles.proto.common.v1 import common_pb2
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.assemble import assemble
from miles.trainer.batch import samples_from_group
from miles.trainer.checkpoint import CheckpointStore
from miles.trainer.step import run_step

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TRAIN: dict[str, Any] = {"batch_size_groups": 2, "micro_batch_max_tokens": 20, "pull_wait_s": 0.5, "max_staleness": 100}
# Two minibatches x two epochs (a forward-only scoring pass through the pipeline for pi_old, four optimizer steps
# per trainer step) and a KL term (reference logprobs through the pipeline once per minibatch, kept for epoch 2).
TRAIN |= {"num_minibatches": 2, "ppo_epochs": 2, "loss": {"kl_coef": 0.05}}
# As in test_trainer_fsdp.py: eps = 1 keeps the first updates ~linear in the gradient.
OPTIMIZER = {"lr": 1e-2, "eps": 1.0, "grad_clip_norm": None}
RESUMED_LOGPROB_TOLERANCE = 1e-5
"""Megatron's logprobs from the restored weights vs the torch backend's from the checkpoint's export (the backends
agree within 1e-5 on this model: test_trainer_megatron.py)."""


async def test_pipeline_parallel_trainer_resumes_from_its_checkpoint_and_matches_one_process(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    groups = [make_group(f"g{i}", seed=i, num_samples=3, num_response_tokens=5 + i) for i in range(4)]
    async with BufferClient(buffer_process.target) as buffer:
        await buffer.configure_job(job_id)
        for group in groups:
            await buffer.push_group(job_id, group)
    env = make_trainer_env(
        job_id=job_id, buffer=buffer_process, model_dir=small_model_dir, checkpoint_dir=tmp_path / "ckpt"
    )
    config_file = tmp_path / "trainer.json"
    settings = {"backend": "megatron", "megatron": {"pp_size": 2}, "train": {**TRAIN, "optimizer": OPTIMIZER}}
    config_file.write_text(json.dumps(settings))
    env |= {"MILES_TRAINER_CONFIG_FILE": str(config_file), "PYTHONWARNINGS": "ignore"}
    for num_steps in (1, 2):
        trainer = start_trainer({**env, "MILES_TRAINER_TRAIN__NUM_STEPS": str(num_steps)})
        trainer.argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        trainer.argv += ["--master-port", str(free_port()), console_script("miles-trainer")]
        status = trainer.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
        assert (status.step, status.weight_version) == (num_steps, num_steps)
        assert status.last_step_metrics["num_micro_batches"] >= 2
        assert status.last_step_metrics["num_optimizer_steps"] == 4
        trainer.stop()
        assert trainer.process is not None
        log_text = trainer.process.log_path.read_text()
        assert '"service": "trainer-1"' in log_text and '"msg": "worker stopping"' in log_text
    assert '"restored": true' in log_text
    parallel = read_safetensors_dir(tmp_path / "ckpt" / "step-00000002" / "model")

    from miles.trainer.backends.megatron_backend import MegatronBackend  # megatron-core only when it runs

    config = TrainConfig(**TRAIN, num_steps=2, optimizer=OPTIMIZER)  # type: ignore[arg-type]
    single = MegatronBackend(ModelConfig.from_dir(small_model_dir), read_safetensors_dir(small_model_dir), config)
    for step, pair in enumerate((groups[:2], groups[2:])):
        samples = [samples_from_group(group, i, vocab_size=512, max_positions=32768) for i, group in enumerate(pair)]
        plan = assemble(samples, [0, 0], config, trainer_version=step, world_size=1).plan
        assert run_step(single, plan, config).violation is None
    expected = single.hf_state_dict()
    initial = read_safetensors_dir(small_model_dir)
    moved = max((expected[n] - initial[n].float()).abs().max().item() for n in expected)
    assert moved > 1e-4
    assert parallel.keys() == expected.keys()
    difference = max((parallel[n].float() - expected[n]).abs().max().item() for n in expected)
    assert difference < 1e-5 < moved, (difference, moved)
    print(f"PP = 2 trainer after 2 steps and a restart vs one process: max |diff| {difference:.3g} (moved {moved:.3g})")


def _torch_on_policy(model: Any, group: common_pb2.Group, version: int) -> common_pb2.Group:
    """The group with the model's own logprobs (the torch backend's forward) as rollout logprobs of `version`."""
    for sample in group.samples:
        with torch.no_grad():
            logprobs = sequence_logprobs(model, torch.tensor(list(sample.tokens)), start=sample.response_start)
        del sample.rollout_logprobs[:]
        sample.rollout_logprobs.extend(logprobs.tolist())
        del sample.weight_versions[:]
        sample.weight_versions.add(start=0, end=len(sample.loss_mask), weight_version=version)
    return group


def _start_megatron(start_trainer: Any, env: dict[str, str], *, ranks: int, num_steps: int) -> Any:
    trainer = start_trainer({**env, "MILES_TRAINER_TRAIN__NUM_STEPS": str(num_steps)})
    if ranks > 1:
        trainer.argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        trainer.argv += ["--master-port", str(free_port()), console_script("miles-trainer")]
    status = trainer.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
    trainer.stop()
    return status


async def test_data_parallel_2_checkpoint_resumes_at_one_rank_with_its_optimizer_state(
    buffer_process: Any,
    small_model_dir: Path,
    tmp_path: Path,
    job_id: str,
    make_group: Any,
    make_trainer_env: Any,
    start_trainer: Any,
) -> None:
    """Megatron at DP = 2 (2 gloo ranks, TP = PP = 1) trains step 1 and checkpoints (weights and AdamW moments
    gathered to rank 0, `full` format); the 2-rank trainer and a 1-rank trainer resuming from a copy of that
    checkpoint then train the same step 2. The next step's logprobs both compute from the restored weights equal
    the checkpoint's Hugging Face export scored by the torch backend (within Megatron-vs-torch rounding), and their
    step-2 weights agree, while the same step from fresh optimizer state lands measurably elsewhere."""
    config_file = tmp_path / "trainer.json"
    train = {"batch_size_groups": 2, "micro_batch_max_tokens": 20, "pull_wait_s": 0.5, "max_staleness": 100}
    config_file.write_text(json.dumps({"backend": "megatron", "train": {**train, "optimizer": OPTIMIZER}}))

    def env_of(job: str, checkpoint_dir: Path) -> dict[str, str]:
        env: dict[str, str] = make_trainer_env(
            job_id=job, buffer=buffer_process, model_dir=small_model_dir, checkpoint_dir=checkpoint_dir
        )
        return env | {"MILES_TRAINER_CONFIG_FILE": str(config_file), "PYTHONWARNINGS": "ignore"}

    async def push(job: str, groups: list[common_pb2.Group]) -> None:
        async with BufferClient(buffer_process.target) as buffer:
            await buffer.configure_job(job)
            for group in groups:
                await buffer.push_group(job, group)

    await push(job_id, [make_group(f"a{i}", seed=i, num_samples=3, num_response_tokens=5 + i) for i in range(2)])
    two_dir, one_dir = tmp_path / "dp2", tmp_path / "dp1"
    assert _start_megatron(start_trainer, env_of(job_id, two_dir), ranks=2, num_steps=1).step == 1
    state = CheckpointStore(two_dir, keep_last=2, source_model_dir=None).read_state(1)
    assert (state.backend, state.format, state.world_size) == ("megatron", "full", 2)
    step1_model = two_dir / "step-00000001" / "model"
    reference = load_model(step1_model)
    second = [
        _torch_on_policy(reference, make_group(f"b{i}", seed=10 + i, num_samples=3, num_response_tokens=6), 1)
        for i in range(2)
    ]
    shutil.copytree(two_dir, one_dir)
    other_job = f"{job_id}-dp1"
    await push(job_id, second)
    await push(other_job, second)
    at_two = _start_megatron(start_trainer, env_of(job_id, two_dir), ranks=2, num_steps=2)
    at_one = _start_megatron(start_trainer, env_of(other_job, one_dir), ranks=1, num_steps=2)
    for status in (at_two, at_one):
        assert (status.step, status.weight_version) == (2, 2)
        assert status.last_step_metrics["current_version_logprob_abs_diff_max"] < RESUMED_LOGPROB_TOLERANCE

    weights_two = read_safetensors_dir(two_dir / "step-00000002" / "model")
    weights_one = read_safetensors_dir(one_dir / "step-00000002" / "model")
    initial = read_safetensors_dir(step1_model)
    from miles.trainer.backends.megatron_backend import MegatronBackend  # megatron-core only when it runs

    config = TrainConfig(**train, num_steps=2, optimizer=OPTIMIZER)  # type: ignore[arg-type]
    fresh_backend = MegatronBackend(ModelConfig.from_dir(step1_model), initial, config)
    samples = [samples_from_group(group, i, vocab_size=512, max_positions=32768) for i, group in enumerate(second)]
    plan = assemble(samples, [0, 0], config, trainer_version=1, world_size=1).plan
    assert run_step(fresh_backend, plan, config).violation is None
    fresh = fresh_backend.hf_state_dict()

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max((a[name].float() - b[name].float()).abs().max().item() for name in a)

    moved = distance(weights_two, initial)
    assert moved > 1e-4
    assert weights_one.keys() == weights_two.keys()
    resumed_gap, fresh_gap = distance(weights_one, weights_two), distance(fresh, weights_two)
    logprob_gaps = [s.last_step_metrics["current_version_logprob_abs_diff_max"] for s in (at_two, at_one)]
    print(
        f"megatron DP=2 -> DP=1: step-2 logprobs vs torch's of the checkpoint {logprob_gaps[0]:.3g} (DP=2),"
        f" {logprob_gaps[1]:.3g} (DP=1); step-2 weights DP=1 vs DP=2 {resumed_gap:.3g}, fresh AdamW vs DP=2"
        f" {fresh_gap:.3g} (moved {moved:.3g})"
    )
    assert resumed_gap < 1e-3 * moved
    assert fresh_gap > 0.1 * moved  # the restored AdamW moments are what made the two agree
