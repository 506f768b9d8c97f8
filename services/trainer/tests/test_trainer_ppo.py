"""PPO with a learned critic (`loss.advantage_estimator: gae`, `train.critic`) on the torch backend, in process.

- Learning: the toy verifiable task of `miles.trainer.toy_task` (reward = fraction of response tokens with id < 64
  out of a 512-token vocabulary; a random policy scores ~0.125) on the small-vocabulary tiny model, 12 sync steps
  of 4 groups x 8 samples x 8 tokens, rollouts sampled from the trainer's current weights each step, trained by
  the trainer's own code path (assemble -> run_step) with GAE advantages from the value head; once with one
  optimizer step per trainer step (the value clip never binds), once with 2 epochs x 2 minibatches (it does).
  Measured on the 2-core machine (seed, first two steps' mean reward -> last three's, runtime):
      one update per step       seed 0: 0.141 -> 1.000 (~5 s)
      2 epochs x 2 minibatches  seed 1: 0.188 -> 0.777 (~3 s)
- Checkpoints hold the value head (`critic/`) and its AdamW state, and a restored trainer takes exactly the same
  next step; the published weights (`hf_state_dict`) never hold it; a checkpoint of the other kind is refused.
- The value loss reaches the policy's weights only with `shared_trunk`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from miles.common.errors import ConfigError
from miles.common.jobspec.trainer import TrainConfig
from miles.model import load_model, load_named_tensors, read_safetensors_dir
from miles.trainer.assemble import assemble
from miles.trainer.backends.torch_backend import TorchBackend, load_policy
from miles.trainer.batch import TrainSample, samples_from_group
from miles.trainer.checkpoint import CRITIC_DIR, CRITIC_WEIGHTS_FILE, MODEL_DIR, CheckpointStore, TrainerState
from miles.trainer.distributed import RankRunner
from miles.trainer.step import StepResult, run_step
from miles.trainer.toy_task import ToyTask, mean_reward, sample_group

StepGroupsFactory = Callable[..., list[list[TrainSample]]]
PPO: dict[str, Any] = {"loss": {"advantage_estimator": "gae"}, "critic": {}}
NUM_STEPS = 12
GROUPS = 4


def ppo_config(**overrides: Any) -> TrainConfig:
    raw: dict[str, Any] = {**PPO, "optimizer": {"lr": 1e-2}, "batch_size_groups": GROUPS, "mode": "sync"}
    return TrainConfig.model_validate(raw | overrides)


def step(backend: TorchBackend, config: TrainConfig, groups: list[list[TrainSample]], version: int = 0) -> StepResult:
    plan = assemble(groups, [0] * len(groups), config, trainer_version=version, world_size=1).plan
    result = run_step(backend, plan, config)
    assert result.violation is None
    return result


def learn(model_dir: Path, config: TrainConfig, seed: int) -> tuple[list[float], list[dict[str, float]]]:
    """Mean reward of each version's rollouts, and each trainer step's statistics."""
    backend, policy, task = load_policy(model_dir, config), load_model(model_dir), ToyTask()
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    rewards, stats = [], []
    for version in range(NUM_STEPS):
        groups = [
            sample_group(policy, task, group_id=f"g{i}", version=version, rng=rng, generator=generator)
            for i in range(GROUPS)
        ]
        rewards.append(mean_reward(groups))
        samples = [samples_from_group(g, i, vocab_size=512, max_positions=32768) for i, g in enumerate(groups)]
        stats.append(step(backend, config, samples, version).stats)
        load_named_tensors(policy, backend.hf_state_dict(), require_all=True)
    return rewards, stats


@pytest.mark.parametrize(
    ("seed", "updates"), [(0, {}), (1, {"ppo_epochs": 2, "num_minibatches": 2})], ids=["one-update", "epochs"]
)
def test_ppo_with_a_critic_raises_the_mean_reward_of_the_toy_task(
    small_model_dir: Path, seed: int, updates: dict[str, int]
) -> None:
    config = ppo_config(**updates)
    rewards, stats = learn(small_model_dir, config, seed)
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print(f"seed {seed} {updates}: mean reward by version {[round(r, 3) for r in rewards]}")
    assert last >= 0.5 and last >= first + 0.3, rewards
    assert all(s["value_loss"] > 0 and "value_explained_variance" in s for s in stats)
    # The head starts at 0 and follows the returns up: its mean prediction is near the last batch's mean return.
    assert stats[0]["value_mean"] == 0.0
    assert stats[-1]["value_mean"] == pytest.approx(stats[-1]["return_mean"], abs=0.25)
    clipped = [s["value_clipfrac"] for s in stats]
    if updates:  # the value clip binds from the second optimizer step of a trainer step on
        assert max(clipped) > 0, clipped
    else:
        assert max(clipped) == 0.0, clipped


def test_checkpoint_holds_the_value_head_and_its_optimizer_state_and_resumes_to_the_same_step(
    small_model_dir: Path, make_step_groups: StepGroupsFactory, tmp_path: Path
) -> None:
    config = ppo_config(ppo_epochs=2)
    groups = make_step_groups(small_model_dir, deterministic=False)
    backend = load_policy(small_model_dir, config)
    first = step(backend, config, groups)
    assert first.num_optimizer_steps == 2
    tensors, optimizer = RankRunner(backend, config).full_state()
    store = CheckpointStore(tmp_path, keep_last=2, source_model_dir=small_model_dir)
    path = store.write(TrainerState(job_id="j", step=1, weight_version=1), tensors, optimizer, {})

    head = load_file(str(path / CRITIC_DIR / CRITIC_WEIGHTS_FILE))
    assert set(head) == {"value_head.weight", "value_head.bias"} and head["value_head.weight"].abs().sum() > 0
    model_names = set(read_safetensors_dir(path / MODEL_DIR))
    assert model_names == set(dict(load_model(small_model_dir).named_parameters()))  # the policy only
    assert set(backend.hf_state_dict()) == model_names  # and so are the published weights
    saved_optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    assert {"value_head.weight", "value_head.bias"} <= set(saved_optimizer["state"])

    restored = load_policy(small_model_dir, config)
    loaded = store.load(1)
    RankRunner(restored, config).load_state(loaded.tensors, loaded.optimizer)
    assert restored.policy.value_head is not None and backend.policy.value_head is not None
    assert torch.equal(restored.policy.value_head.weight, backend.policy.value_head.weight)
    next_groups = make_step_groups(small_model_dir, deterministic=False, num_groups=2, per_group=2)
    original_next, restored_next = step(backend, config, next_groups, 1), step(restored, config, next_groups, 1)
    for name in ("loss", "value_loss", "value_mean", "value_explained_variance"):
        assert restored_next.stats[name] == original_next.stats[name], name
    assert restored_next.grad_norm == original_next.grad_norm
    after, after_restored = backend.checkpoint_tensors(), restored.checkpoint_tensors()
    assert set(after) == set(after_restored) and all(torch.equal(after[n], after_restored[n]) for n in after)


def test_a_checkpoint_with_or_without_a_value_head_resumes_only_a_job_of_its_kind(
    small_model_dir: Path, tmp_path: Path
) -> None:
    critic_job, plain_job = ppo_config(), TrainConfig()
    for source, target, said in (
        (critic_job, plain_job, "this job has no train.critic"),
        (plain_job, critic_job, "holds no value head"),
    ):
        store = CheckpointStore(tmp_path / said.replace(" ", "-"), keep_last=1, source_model_dir=small_model_dir)
        tensors, optimizer = RankRunner(load_policy(small_model_dir, source), source).full_state()
        store.write(TrainerState(job_id="j", step=1, weight_version=1), tensors, optimizer, {})
        with pytest.raises(ConfigError, match=said) as refused:
            load_policy(small_model_dir, target).load_checkpoint_tensors(store.load(1).tensors)
        assert refused.value.field == "train.critic"


@pytest.mark.parametrize("shared_trunk", [False, True])
def test_the_value_loss_reaches_the_policy_weights_only_with_a_shared_trunk(
    small_model_dir: Path, make_step_groups: StepGroupsFactory, shared_trunk: bool
) -> None:
    config = ppo_config(critic={"shared_trunk": shared_trunk})
    backend = load_policy(small_model_dir, config)
    samples = make_step_groups(small_model_dir, deterministic=False)[0]
    head = backend.policy.value_head
    assert head is not None
    with torch.no_grad():
        zero = backend.forward(samples, temperature=1.0, entropy_grad=False).values
        assert zero is not None and torch.equal(zero, torch.zeros_like(zero))  # the head starts at 0
        head.weight.fill_(0.01)  # else dV/dh = 0 and no gradient reaches the trunk anyway
    outputs = backend.forward(samples, temperature=1.0, entropy_grad=False)
    assert outputs.values is not None and outputs.values.shape == outputs.logprobs.shape
    ((outputs.values - 1.0) ** 2).sum().backward()  # a value loss alone
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    policy_grads = [p.grad for p in backend.policy.lm.parameters()]
    if shared_trunk:
        assert any(grad is not None and grad.abs().sum() > 0 for grad in policy_grads)
    else:
        assert all(grad is None for grad in policy_grads)
