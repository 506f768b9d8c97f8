"""Acceptance: a PPO-with-critic job (`loss.advantage_estimator: gae`, `train.critic`) runs end to end on the local
backend and learns the demo task.

The `make run` demo job (`examples/calculator_tool/job.yaml`: multi-turn calculator tool use in the sandbox,
partial-credit reward, the demo's warmed-up tiny model, fully-async with max staleness 1) with GAE advantages from
a value head on the policy instead of GRPO's group baseline, cut to NUM_STEPS steps. Its engine, rollout worker,
weight-sync origin and trainer are real processes, over the `stack`'s shared services (Redis, router, session
server, buffer, sandbox gateway). The samples are multi-turn: the calculator's output tokens between two model
turns have loss mask 0, so GAE steps over them.

Trained on the demo dataset's first BATCH_SIZE_GROUPS prompts (every step the same, so the reward by step measures
the policy, not the prompts drawn) at policy lr POLICY_LR: at the demo's 1e-3 PPO collapsed in 2 of 3 runs (the
trainer README, "PPO with a critic"). At 5e-4: 0.47 -> 0.86, 0.46 -> 0.91, 0.47 -> 0.82, 0.37 -> 0.86 (first vs
last 3 steps), and one collapse in a CI rehearsal (0.51 -> 0.17: reward 0.75 at step 4, then entropy 0.05 -> 0.27 and
longer answers). At 3e-4 with critic lr 1e-2: 0.34 -> 0.80, 0.48 -> 0.67, 0.48 -> 0.87, and one CI rehearsal
failed (0.42 -> 0.52, below the margin: see CRITIC_LR). At 3e-4 with critic lr 3e-3: 0.40 -> 0.67, 0.39 -> 0.92,
0.36 -> 0.87, 0.45 -> 0.85; its value_mean climbs to ~0.63 by step 10 and stays in the reward range, but
value_explained_variance is still negative (-0.3 to -0.7 at step 10): the critic does not explain the returns yet.

Checked: the job SUCCEEDS at its last step and version (the engines took every published version: the value head
is not among the weights they serve); the mean reward of the last steps is above that of the first ones by the
demo's margin (`scripts/demo.py`'s reward_first / reward_last); every step reports the critic's metrics; the last
checkpoint holds the value head in `critic/` and the policy alone in `model/`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from safetensors import safe_open

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import JobProgress
from miles.controller.backends.local import LocalJobBackend

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_ID = "ppo-demo"
NUM_STEPS = 10
BATCH_SIZE_GROUPS = 4
POLICY_LR = 3e-4
CRITIC_LR = 3e-3
"""The value head's lr. At 1e-2 a CI rehearsal's head overshot the reward range (value_mean 1.2 at step 8,
rewards <= 1) and the run collapsed after a peak (0.77 at step 7, then 0.41 at step 10, entropy 0.05 -> 0.17)."""
"""The demo's: every step trains on the demo dataset's first 4 prompts (conftest's demo_job_on_first_prompts)."""
"""The demo's 20 steps of 4 groups (8 episodes each), cut in half to fit the test."""
MIN_RISE = 0.1
"""reward_last - reward_first needed, as `scripts/demo.py --min-rise` by default."""
CRITIC_METRICS = ("value_loss", "value_clipfrac", "value_mean", "value_explained_variance")


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=True)


@pytest.fixture(scope="module")
def demo() -> ModuleType:
    """`scripts/demo.py` (the `make run` demo): its reward_first / reward_last margin."""
    spec = importlib.util.spec_from_file_location("miles_demo_script", REPO_ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ppo_demo_job(model: Path, spec: dict[str, Any]) -> JobSpec:
    """The demo's job spec with PPO's critic in place of GRPO, cut to NUM_STEPS steps."""
    spec["model"]["path"] = str(model)
    spec["train"].update(num_steps=NUM_STEPS, checkpoint_interval_steps=NUM_STEPS)
    spec["train"]["loss"]["advantage_estimator"] = "gae"
    spec["train"]["critic"] = {"lr": CRITIC_LR}  # the head starts at 0: it needs more than the policy's lr
    spec["train"]["optimizer"]["lr"] = POLICY_LR
    return JobSpec.model_validate(spec)


def run_to_the_end(
    loop: asyncio.AbstractEventLoop, backend: LocalJobBackend, spec: JobSpec
) -> tuple[JobProgress, dict[int, dict[str, float]]]:
    """The final progress and the trainer's step metrics of every step observed (by step)."""
    by_step: dict[int, dict[str, float]] = {}
    while True:
        progress: JobProgress = loop.run_until_complete(backend.observe(JOB_ID, spec))
        if progress.step > 0 and "reward_mean" in progress.metrics:
            by_step[progress.step] = dict(progress.metrics)
        if progress.phase in ("succeeded", "failed"):
            return progress, by_step
        time.sleep(0.5)


def test_a_ppo_job_with_a_critic_learns_the_demo_task_and_checkpoints_its_value_head(
    stack: Any,
    tmp_path: Path,
    demo: ModuleType,
    demo_model: Callable[[str], Path],
    demo_job_on_first_prompts: Callable[[int], dict[str, Any]],
) -> None:
    model = demo_model("calculator-demo")  # the demo job's model (`make run`'s copy when present)
    spec = ppo_demo_job(model, demo_job_on_first_prompts(BATCH_SIZE_GROUPS))
    assert spec.placement_problems() == [] and spec.train.recipe_problems() == []
    stack.register_job(JOB_ID, engine_pool=JOB_ID, model_path=model)
    services = stack.shared_services()
    loop = asyncio.new_event_loop()
    backend = LocalJobBackend(services, tmp_path / "state", cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    started = time.monotonic()
    try:
        loop.run_until_complete(backend.start(JOB_ID, spec))
        progress, by_step = run_to_the_end(loop, backend, spec)
        job_dir = backend.job_dir(JOB_ID)
        logs = {p.name: p.read_text(errors="replace")[-3000:] for p in job_dir.glob("*.log")}
        assert progress.phase == "succeeded", f"{progress}; logs: {json.dumps(logs, indent=1)}"
        assert progress.step == NUM_STEPS and progress.weight_version == NUM_STEPS, progress
    finally:
        loop.run_until_complete(backend.stop(JOB_ID))
        loop.run_until_complete(backend.close())
        loop.close()

    rewards = {step: metrics["reward_mean"] for step, metrics in by_step.items()}
    first, last = demo.edge_mean(rewards, last=False), demo.edge_mean(rewards, last=True)
    critic = {step: {name: round(metrics[name], 3) for name in CRITIC_METRICS} for step, metrics in by_step.items()}
    print(f"ppo job: {time.monotonic() - started:.0f}s, rewards by step {rewards}, first {first:.3f} last {last:.3f}")
    print(f"critic by step: {critic}")
    keys = ("num_samples", "num_trainable_samples", "response_length_mean", "entropy")
    table = {step: [round(m.get(k, float("nan")), 3) for k in keys] for step, m in sorted(by_step.items())}
    print(f"ppo job: {keys} by step {table}")
    assert len(rewards) >= 2 * demo.NUM_EDGE_STEPS, f"too few steps observed: {sorted(rewards)}"
    assert last - first >= MIN_RISE, rewards
    for step, metrics in by_step.items():
        assert metrics["num_loss_tokens"] > 0 and metrics["value_loss"] > 0, (step, metrics)
        assert all(name in metrics for name in CRITIC_METRICS), (step, metrics)

    checkpoint = job_dir / "checkpoints" / f"step-{NUM_STEPS:08d}"
    assert sorted(p.name for p in checkpoint.iterdir() if p.is_dir()) == ["critic", "model"], list(checkpoint.iterdir())
    with safe_open(str(checkpoint / "critic" / "value_head.safetensors"), framework="pt") as head:
        assert sorted(head.keys()) == ["value_head.bias", "value_head.weight"]
    with safe_open(str(checkpoint / "model" / "model.safetensors"), framework="pt") as weights:
        names = list(weights.keys())
    assert names and not any("value_head" in name for name in names), names
