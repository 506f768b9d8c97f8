"""A trainer step with several optimizer steps (ppo_epochs, num_minibatches) on the torch backend, in process:
the clip acts from the second update on (its fraction pinned by an independent computation), pi_old and the
TIS weights stay those of the weights before the first update, the LR schedule advances once per trainer step;
and an optimizer step without signal touches nothing (weights, Adam moments and step count, scheduler)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.model import CausalLM, load_model, load_named_tensors, sequence_logprobs
from miles.trainer.assemble import assemble
from miles.trainer.backends.torch_backend import TorchBackend, load_policy
from miles.trainer.batch import TrainSample
from miles.trainer.step import StepPlan, StepResult, run_step

StepGroupsFactory = Callable[..., list[list[TrainSample]]]
NO_CLIP = {"grad_clip_norm": None}


def _step(model_dir: Path, config: TrainConfig, groups: list[list[TrainSample]]) -> tuple[TorchBackend, StepResult]:
    backend = load_policy(model_dir, config)
    plan = assemble(groups, [0] * len(groups), config, trainer_version=0, world_size=1).plan
    return backend, run_step(backend, plan, config)


def _adam_step_counts(backend: TorchBackend) -> set[int]:
    return {int(state["step"]) for state in backend.optimizer.state.values()}


def _clipped_fraction(
    before: CausalLM, after: CausalLM, samples: list[TrainSample], config: TrainConfig
) -> tuple[float, float]:
    """Independently of the trainer: the fraction of loss tokens of `samples` on which PPO takes the clipped
    branch for ratio = pi_after / pi_before (miles.model's own scoring), and the closest a ratio came to a bound."""
    low, high = 1.0 - config.loss.clip_low, 1.0 + config.loss.clip_high
    num_clipped, num_tokens, margin = 0, 0, math.inf
    for sample in samples:
        tokens = torch.tensor(sample.tokens)
        with torch.no_grad():
            old = sequence_logprobs(before, tokens, start=sample.response_start)
            new = sequence_logprobs(after, tokens, start=sample.response_start)
        for ratio, mask in zip(torch.exp(new - old).tolist(), sample.loss_mask, strict=True):
            if mask:
                num_tokens += 1
                num_clipped += (sample.advantage > 0 and ratio > high) or (sample.advantage < 0 and ratio < low)
                margin = min(margin, abs(ratio - high), abs(ratio - low))
    return num_clipped / num_tokens, margin


def test_one_update_per_step_never_clips(small_model_dir: Path, make_step_groups: StepGroupsFactory) -> None:
    groups = make_step_groups(small_model_dir, deterministic=False)
    _, result = _step(small_model_dir, TrainConfig(optimizer={"lr": 1e-2, **NO_CLIP}), groups)
    assert result.num_optimizer_steps == 1
    assert result.stats["pg_clipfrac"] == 0.0
    assert result.stats["ppo_ratio_min"] == result.stats["ppo_ratio_max"] == 1.0


@pytest.mark.parametrize(("ppo_epochs", "num_minibatches", "lr"), [(2, 1, 2e-4), (1, 2, 1e-2)])
def test_the_clip_acts_from_the_second_update_and_its_fraction_matches_an_independent_computation(
    small_model_dir: Path, make_step_groups: StepGroupsFactory, ppo_epochs: int, num_minibatches: int, lr: float
) -> None:
    optimizer = {"lr": lr, **NO_CLIP}
    config = TrainConfig(optimizer=optimizer, ppo_epochs=ppo_epochs, num_minibatches=num_minibatches)
    groups = make_step_groups(small_model_dir, deterministic=False)
    plan = assemble(copy.deepcopy(groups), [0, 0], config, trainer_version=0, world_size=1).plan
    _, result = _step(small_model_dir, config, groups)
    assert result.num_optimizer_steps == 2

    # The first update alone, as a default one-update step on the data of the first update.
    single = TrainConfig(optimizer=optimizer)
    first = load_policy(small_model_dir, single)
    assert run_step(first, StepPlan(plan.minibatches[:1], trainer_version=0), single).num_optimizer_steps == 1
    before, after = load_model(small_model_dir), load_model(small_model_dir)
    load_named_tensors(after, first.hf_state_dict(), require_all=True)
    # The second update sees pi_theta = the weights after the first and pi_old = the initial weights.
    fraction, margin = _clipped_fraction(before, after, plan.minibatches[-1].samples(), config)
    assert margin > 1e-3, "a ratio sits on a clip bound: the pinned fraction would be fragile"
    assert fraction > 0
    # pg_clipfrac is the mean over the step's two optimizer steps; the first one's ratio is 1 (nothing clipped).
    assert result.stats["pg_clipfrac"] == pytest.approx((0.0 + fraction) / 2, abs=1e-12)
    print(f"pg_clipfrac {result.stats['pg_clipfrac']:.6f} (second update: {fraction:.6f})")


def test_pi_old_and_tis_weights_stay_fixed_over_epochs_and_the_schedule_advances_once(
    small_model_dir: Path, make_step_groups: StepGroupsFactory
) -> None:
    groups = make_step_groups(small_model_dir, deterministic=False)
    for sample in groups[0]:
        sample.rollout_logprobs = [lp - 0.5 for lp in sample.rollout_logprobs]  # mu: 0.5 below pi_old everywhere
    optimizer = {"lr": 1e-2, "warmup_steps": 4, **NO_CLIP}
    config = TrainConfig(optimizer=optimizer, ppo_epochs=3, num_minibatches=2)
    backend, result = _step(small_model_dir, config, groups)
    assert (result.num_optimizer_steps, result.stats["num_optimizer_steps_skipped"]) == (6, 0)
    # every update reports pi_old - mu and the TIS weight of the weights before the first update
    assert result.stats["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5, rel=1e-4)
    assert result.stats["is_weight_max"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert result.stats["ppo_ratio_max"] > 1.0 + 1e-3  # later updates moved away from pi_old
    assert _adam_step_counts(backend) == {6}
    assert backend.scheduler.last_epoch == 1
    assert result.learning_rate == pytest.approx(1e-2 / 4)  # warm-up step 1 of 4 ...
    assert backend.learning_rate() == pytest.approx(2e-2 / 4)  # ... then step 2 of 4: one scheduler step


def test_strict_on_policy_is_checked_on_the_scoring_pass_before_any_update(
    small_model_dir: Path, make_step_groups: StepGroupsFactory
) -> None:
    groups = make_step_groups(small_model_dir, deterministic=True)
    groups[1][2].rollout_logprobs[3] += 1e-3
    config = TrainConfig(deterministic=True, strict_on_policy=True, ppo_epochs=2, optimizer={"lr": 1e-2})
    backend, result = _step(small_model_dir, config, groups)
    assert result.violation is not None and "max abs diff 0.001" in result.violation
    initial = load_model(small_model_dir).state_dict()
    after = backend.hf_state_dict()
    assert all(torch.equal(after[name], initial[name]) for name in after) and not backend.optimizer.state


def _equal_rewards(groups: list[list[TrainSample]], *indices: int) -> None:
    for index in indices:
        for sample in groups[index]:
            sample.reward = 0.1  # 0.1 * 3 / 3 != 0.1 in floats: the advantage must still be exactly 0


def test_a_step_without_signal_touches_neither_weights_nor_adam_nor_the_schedule(
    small_model_dir: Path, make_step_groups: StepGroupsFactory
) -> None:
    groups = make_step_groups(small_model_dir, deterministic=False)
    _equal_rewards(groups, 0, 1)
    config = TrainConfig(optimizer={"lr": 1e-2, "weight_decay": 0.1}, ppo_epochs=2)
    backend, result = _step(small_model_dir, config, groups)
    assert all(sample.advantage == 0.0 for group in groups for sample in group)
    assert result.num_optimizer_steps == 0 and result.stats["num_optimizer_steps_skipped"] == 2
    initial = load_model(small_model_dir).state_dict()
    after = backend.hf_state_dict()
    assert all(torch.equal(after[name], initial[name]) for name in after)
    assert not backend.optimizer.state and backend.scheduler.last_epoch == 0

    # An entropy bonus is a signal of its own: the same data then trains.
    with_entropy = TrainConfig(optimizer={"lr": 1e-2}, loss={"entropy_coef": 0.01})
    _, entropy_result = _step(small_model_dir, with_entropy, groups)
    assert entropy_result.num_optimizer_steps == 1


def test_only_the_minibatches_with_signal_take_optimizer_steps(
    small_model_dir: Path, make_step_groups: StepGroupsFactory
) -> None:
    groups = make_step_groups(small_model_dir, deterministic=False)
    _equal_rewards(groups, 0)  # minibatch 0 = group 0 (3 samples), minibatch 1 = group 1
    config = TrainConfig(optimizer={"lr": 1e-2}, ppo_epochs=2, num_minibatches=2)
    backend, result = _step(small_model_dir, config, groups)
    assert (result.num_optimizer_steps, result.stats["num_optimizer_steps_skipped"]) == (2, 2)
    assert _adam_step_counts(backend) == {2} and backend.scheduler.last_epoch == 1
