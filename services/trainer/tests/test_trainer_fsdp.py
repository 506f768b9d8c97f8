"""The multi-process path for real: miles-trainer launched by `torch.distributed.run --nproc_per_node 2` (gloo on
the CPU, FSDP2-sharded policy, rank 0 driving rank 1) trains one step from the buffer, is stopped, restarts from
its checkpoint (weights and Adam state broadcast from rank 0 into the shards) and trains the second; the final
checkpoint equals a single-process computation of the same two steps. Once with one optimizer step per trainer
step, once with two minibatches x two epochs (a scoring pass for pi_old, four optimizer steps per trainer step,
ranks with fewer micro-batches running empty ones in every pass), and that again as PPO with a critic (the value
head sharded with the policy, its GAE advantages whitened over both ranks, its checkpoint restored)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from miles.buffer.client import BufferClient
from miles.common.jobspec.trainer import TrainConfig
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.model import load_model, read_safetensors_dir
from miles.proto.trainer.v1 import trainer_pb2
from miles.trainer.assemble import assemble
from miles.trainer.backends.torch_backend import load_policy
from miles.trainer.batch import samples_from_group
from miles.trainer.checkpoint import CRITIC_DIR, CRITIC_PREFIX, CRITIC_WEIGHTS_FILE
from miles.trainer.step import run_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TRAIN = {"batch_size_groups": 2, "micro_batch_max_tokens": 20, "pull_wait_s": 0.5, "max_staleness": 100}
# Adam with eps = 1 makes the first updates ~linear in the gradient, so float noise in near-zero gradients
# (which Adam's default eps would amplify to full-size updates) cannot hide a real difference.
OPTIMIZER = {"lr": 1e-2, "eps": 1.0, "grad_clip_norm": None}
PPO_CRITIC = {"loss": {"advantage_estimator": "gae"}, "critic": {"lr": 1e-2}, "num_minibatches": 2, "ppo_epochs": 2}


@pytest.mark.parametrize(
    "recipe",
    [{}, {"num_minibatches": 2, "ppo_epochs": 2}, PPO_CRITIC],
    ids=["one_update", "minibatches_and_epochs", "ppo_critic"],
)
async def test_two_rank_fsdp_trainer_with_a_restart_matches_single_process_training(
    recipe: dict[str, Any],
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
    # The recipe comes in the JSON file the controller writes (below the environment in precedence).
    config_file = tmp_path / "trainer.json"
    config_file.write_text(json.dumps({"train": {**TRAIN, **recipe, "optimizer": OPTIMIZER}}))
    env["MILES_TRAINER_CONFIG_FILE"] = str(config_file)
    for num_steps in (1, 2):
        trainer = start_trainer({**env, "MILES_TRAINER_TRAIN__NUM_STEPS": str(num_steps)})
        trainer.argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master-port",
            str(free_port()),
            console_script("miles-trainer"),
        ]
        status = trainer.start().wait_for(lambda s: s.state == trainer_pb2.TRAINER_STATE_FINISHED)
        assert (status.step, status.weight_version) == (num_steps, num_steps)
        assert status.last_step_metrics["num_micro_batches"] >= 2
        assert status.last_step_metrics["num_optimizer_steps"] == recipe.get("num_minibatches", 1) * recipe.get(
            "ppo_epochs", 1
        )
        trainer.stop()
        assert trainer.process is not None
        log_text = trainer.process.log_path.read_text()
        assert '"service": "trainer-1"' in log_text and '"msg": "worker stopping"' in log_text  # rank 1 to the end
    assert '"restored": true' in log_text
    distributed = read_safetensors_dir(tmp_path / "ckpt" / "step-00000002" / "model")

    config = TrainConfig(**TRAIN, **recipe, num_steps=2, optimizer=OPTIMIZER)  # type: ignore[arg-type]
    single = load_policy(small_model_dir, config)
    for step, pair in enumerate((groups[:2], groups[2:])):
        samples = [samples_from_group(group, i, vocab_size=512, max_positions=32768) for i, group in enumerate(pair)]
        plan = assemble(samples, [0, 0], config, trainer_version=step, world_size=1).plan
        assert run_step(single, plan, config).violation is None
    expected = single.hf_state_dict()
    initial = load_model(small_model_dir).state_dict()
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-4
    assert distributed.keys() == expected.keys()
    assert max((distributed[n] - expected[n]).abs().max().item() for n in expected) < 1e-3 * moved
    # The value head: sharded with the policy, restored from rank 0, its advantages whitened over both ranks.
    if "critic" in recipe:
        head = load_file(str(tmp_path / "ckpt" / "step-00000002" / CRITIC_DIR / CRITIC_WEIGHTS_FILE))
        expected_head = {
            n.removeprefix(CRITIC_PREFIX): t
            for n, t in single.checkpoint_tensors().items()
            if n.startswith(CRITIC_PREFIX)
        }
        assert head.keys() == expected_head.keys() == {"value_head.weight", "value_head.bias"}
        head_moved = expected_head["value_head.weight"].abs().max().item()
        assert max((head[n] - expected_head[n]).abs().max().item() for n in head) < 1e-3 * head_moved
