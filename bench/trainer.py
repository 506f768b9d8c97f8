"""make bench-trainer: does GRPO learn, and what does exactness cost? Measured side by side in one run.

1. Learning: the toy verifiable task of `miles.trainer.toy_task` (reward = fraction of response tokens with id
   < 64 out of a 512-token vocabulary) on the small-vocabulary tiny model, 12 GRPO steps of 4 groups x 8
   samples x 8 tokens, rollouts sampled from the current weights each step (sync, on-policy), trained with the
   trainer's own code path (assemble -> run_step on the torch backend); next to it, the same number of
   rollouts from the untrained policy. Same seeds as services/trainer/tests/test_trainer_learning.py, which
   runs the same loop through the real buffer and trainer processes.
2. Exactness cost: tokens per second of one forward/backward/step on the tiny model (151,936-token vocabulary),
   fast path vs deterministic (batch-invariant) mode, same batch.
Writes bench/results/trainer.json.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.common.testing.machine import describe_machine
from miles.engine.tiny_model import build_tiny_model
from miles.model import load_model, load_named_tensors
from miles.trainer.assemble import assemble
from miles.trainer.backends.torch_backend import load_policy
from miles.trainer.batch import TrainSample, samples_from_group
from miles.trainer.step import run_step
from miles.trainer.toy_task import ToyTask, mean_reward, sample_group

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "trainer.json"
NUM_STEPS = 12
GROUPS = 4
SMALL = {"vocab_size": 512, "num_hidden_layers": 2, "max_window_layers": 2}


def learning_curves(model_dir: Path) -> dict[str, list[float]]:
    config = TrainConfig(batch_size_groups=GROUPS, mode="sync", optimizer={"lr": 1e-2})  # type: ignore[arg-type]
    backend = load_policy(model_dir, config)
    policy, untrained = load_model(model_dir), load_model(model_dir)
    task = ToyTask()
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    control_rng, control_generator = random.Random(1), torch.Generator().manual_seed(1)
    trained_rewards, control_rewards, step_s = [], [], []
    for version in range(NUM_STEPS):
        groups = [
            sample_group(policy, task, group_id=f"g{i}", version=version, rng=rng, generator=generator)
            for i in range(GROUPS)
        ]
        control = [
            sample_group(untrained, task, group_id=f"c{i}", version=0, rng=control_rng, generator=control_generator)
            for i in range(GROUPS)
        ]
        trained_rewards.append(mean_reward(groups))
        control_rewards.append(mean_reward(control))
        samples = [samples_from_group(g, i, vocab_size=512, max_positions=32768) for i, g in enumerate(groups)]
        started = time.perf_counter()
        result = run_step(
            backend, assemble(samples, [0] * GROUPS, config, trainer_version=version, world_size=1).plan, config
        )
        step_s.append(time.perf_counter() - started)
        assert result.violation is None
        load_named_tensors(policy, backend.hf_state_dict(), require_all=True)
    return {"grpo": trained_rewards, "untrained": control_rewards, "step_s": step_s}


def throughput(model_dir: Path, *, deterministic: bool, rounds: int = 3) -> float:
    config = TrainConfig(deterministic=deterministic, optimizer={"lr": 1e-4})  # type: ignore[arg-type]
    backend = load_policy(model_dir, config)
    rng = random.Random(5)
    group = []
    for i in range(4):
        tokens = [rng.randrange(1000, 150000) for _ in range(64)]
        group.append(TrainSample("g", f"s{i}", 0, tokens, 16, [1] * 48, [-10.0] * 48, float(i % 2), True, 0, 0))
    plan = assemble([group], [0], config, trainer_version=0, world_size=1).plan
    run_step(backend, plan, config)  # warm-up
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        run_step(backend, plan, config)
        seconds.append(time.perf_counter() - started)
    return 4 * 64 / statistics.median(seconds)


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        small = build_tiny_model(Path(scratch) / "small", config_overrides=SMALL)
        tiny = build_tiny_model(Path(scratch) / "tiny")
        curves = learning_curves(small)
        fast_tps = throughput(tiny, deterministic=False)
        exact_tps = throughput(tiny, deterministic=True)
    last3_trained = statistics.mean(curves["grpo"][-3:])
    last3_control = statistics.mean(curves["untrained"][-3:])
    result = {
        "benchmark": "trainer: GRPO learning on a toy verifiable task; fast vs deterministic step throughput",
        "learning": {
            "task": "reward = fraction of 8 response tokens with id < 64 (vocab 512); 4 groups x 8 samples per step",
            "model": "tiny-qwen3 architecture, vocab 512, 2 layers (miles-make-tiny-model seed 0)",
            "lr": 1e-2,
            "mean_reward_by_version_grpo": [round(r, 4) for r in curves["grpo"]],
            "mean_reward_untrained_policy": [round(r, 4) for r in curves["untrained"]],
            "last3_grpo": round(last3_trained, 4),
            "last3_untrained": round(last3_control, 4),
            "grpo_over_untrained_ratio": round(last3_trained / last3_control, 2),
            "train_step_s_median": round(statistics.median(curves["step_s"]), 3),
        },
        "throughput": {
            "batch": "4 sequences x 64 tokens (48 trained), tiny-qwen3 (vocab 151,936)",
            "fast_tokens_per_s": round(fast_tps, 1),
            "deterministic_tokens_per_s": round(exact_tps, 1),
            "fast_over_deterministic_ratio": round(fast_tps / exact_tps, 2),
        },
        "machine": describe_machine(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"GRPO on the toy task, {NUM_STEPS} steps (one run, side by side)")
    print(f"  mean reward by version   {[round(r, 3) for r in curves['grpo']]}")
    print(f"  untrained policy         {[round(r, 3) for r in curves['untrained']]}")
    print(
        f"  last 3: GRPO / untrained {last3_trained:.3f} / {last3_control:.3f} = {last3_trained / last3_control:.2f}x"
    )
    print("train step throughput on tiny-qwen3")
    print(f"  fast {fast_tps:.1f} tok/s, deterministic {exact_tps:.1f} tok/s, ratio {fast_tps / exact_tps:.2f}x")
    print(f"written to {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
