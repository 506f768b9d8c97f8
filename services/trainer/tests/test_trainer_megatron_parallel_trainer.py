"""The Megatron backend at PP = 2 through the trainer's own launch path: `miles-trainer` under
`torch.distributed.run --nproc_per_node 2` (gloo), settings from the environment (`backend: megatron`,
`megatron.pp_size: 2`), each rank building its stage from the checkpoint directory, rank 0 pulling from a real
buffer and driving rank 1. It trains one step, is stopped, restarts from its checkpoint (weights and AdamW moments
gathered to rank 0 at the checkpoint, scattered back to both stages at the restart) and trains the second; the
final checkpoint equals a single-process Megatron computation of the same two steps. With PP = 2 both ranks are
one data rank, so the plan must give rank 0 the whole batch (core.py plans over `runner.data.size`). The recipe
runs every pipeline pass the trainer has: the scoring pass, the KL reference pass and the 1F1B training pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.buffer.client import BufferClient
from miles.common.jobspec.trainer import TrainConfig
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.model import ModelConfig, read_safetensors_dir
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.assemble import assemble
from miles.trainer.batch import samples_from_group
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

    from miles.trainer.backends.megatron_backend import MegatronBackend

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
