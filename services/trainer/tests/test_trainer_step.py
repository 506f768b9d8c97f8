"""One optimizer step on the torch backend (small-vocabulary tiny model, in process): packing and gradient
accumulation do not change the update, gradient checkpointing does not either, bf16 runs, SFT and KL terms,
and the strict on-policy check."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.common.jobspec.trainer import TrainConfig
from miles.model import load_model, sequence_logprobs
from miles.trainer.assemble import assemble
from miles.trainer.backends.torch_backend import TorchBackend, load_policy
from miles.trainer.batch import TrainSample
from miles.trainer.step import StepPlan, run_step


def make_samples(
    model_dir: Path, *, deterministic: bool, num_groups: int = 2, per_group: int = 3
) -> list[list[TrainSample]]:
    """Groups of random sequences whose rollout logprobs are the model's own (deterministic or fast)."""
    model = load_model(model_dir)
    rng = random.Random(7)
    groups = []
    for g in range(num_groups):
        group = []
        for i in range(per_group):
            length, prompt = rng.randrange(6, 14), rng.randrange(2, 5)
            tokens = [rng.randrange(0, 512) for _ in range(length)]
            with torch.no_grad():
                logprobs = sequence_logprobs(model, torch.tensor(tokens), start=prompt, deterministic=deterministic)
            mask = [1] * (length - prompt)
            mask[0] = 0  # a tool token in the middle of the response: not trained on
            group.append(
                TrainSample(
                    f"g{g}",
                    f"g{g}/{i}",
                    g,
                    tokens,
                    prompt,
                    mask,
                    logprobs.tolist(),
                    float(rng.random() < 0.5),
                    True,
                    0,
                    0,
                )
            )
        groups.append(group)
    return groups


def step_once(model_dir: Path, config: TrainConfig, groups: list[list[TrainSample]]) -> tuple[TorchBackend, Any]:
    backend = load_policy(model_dir, config)
    assembled = assemble(groups, [0] * len(groups), config, trainer_version=0, world_size=1)
    return backend, run_step(backend, assembled.plan, config)


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return backend.hf_state_dict()


BASE = {"optimizer": {"lr": 1e-2, "grad_clip_norm": None}, "loss": {"entropy_coef": 0.01}}
# Adam with eps = 1: the first update is ~lr * g / (|g| + 1), linear in the gradient, so comparing updates
# compares gradients (with the default eps, g / (|g| + 1e-8) amplifies float noise in near-zero gradients).
LINEAR = {"optimizer": {"lr": 1e-2, "eps": 1.0, "grad_clip_norm": None}, "loss": {"entropy_coef": 0.01}}


def test_micro_batching_and_accumulation_give_the_same_update_as_one_batch(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=False)
    whole_backend, whole = step_once(small_model_dir, TrainConfig(micro_batch_max_tokens=4096, **LINEAR), groups)
    split_backend, split = step_once(small_model_dir, TrainConfig(micro_batch_max_tokens=16, **LINEAR), groups)
    assert split.stats["loss"] == pytest.approx(whole.stats["loss"], abs=1e-6)
    assert split.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    before = load_model(small_model_dir).state_dict()
    after_whole, after_split = params(whole_backend), params(split_backend)
    moved = max((after_whole[n] - before[n]).abs().max().item() for n in after_whole)
    assert moved > 1e-5  # the step did something
    # equal up to float32 rounding of the parameters (one ulp at |w| ~ 1 is 1.2e-7)
    assert max((after_whole[n] - after_split[n]).abs().max().item() for n in after_whole) < 1e-3 * moved


def test_gradient_checkpointing_gives_the_same_update(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=False)
    plain_backend, plain = step_once(small_model_dir, TrainConfig(**LINEAR), groups)
    ckpt_backend, ckpt = step_once(small_model_dir, TrainConfig(gradient_checkpointing=True, **LINEAR), groups)
    assert ckpt.stats["loss"] == pytest.approx(plain.stats["loss"], abs=1e-7)
    assert ckpt.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    a, b = params(plain_backend), params(ckpt_backend)
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 2e-7


def test_deterministic_recompute_equals_rollout_logprobs_bit_for_bit_and_strict_mode_passes(
    small_model_dir: Path,
) -> None:
    groups = make_samples(small_model_dir, deterministic=True)
    config = TrainConfig(deterministic=True, strict_on_policy=True, micro_batch_max_tokens=20, **BASE)
    _, result = step_once(small_model_dir, config, groups)
    assert result.violation is None
    assert result.stats["train_rollout_logprob_abs_diff_max"] == 0.0
    assert result.stats["is_ratio"] == 1.0 and result.stats["is_clamped_fraction"] == 0.0


def test_strict_on_policy_fails_the_step_and_leaves_the_weights(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=True)
    groups[1][2].rollout_logprobs[3] += 1e-3
    config = TrainConfig(deterministic=True, strict_on_policy=True, **BASE)
    backend, result = step_once(small_model_dir, config, groups)
    assert result.violation is not None and "max abs diff 0.001" in result.violation
    assert result.stats["current_version_logprob_abs_diff_max"] == pytest.approx(1e-3, rel=1e-3)
    before = load_model(small_model_dir).state_dict()
    after = params(backend)
    assert all(torch.equal(after[n], before[n]) for n in after)


def test_stale_data_is_not_held_to_strict_on_policy(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=True)
    for sample in groups[0]:
        sample.rollout_logprobs = [lp - 0.5 for lp in sample.rollout_logprobs]
        sample.min_version = sample.max_version = -1  # generated by an older version
    config = TrainConfig(deterministic=True, strict_on_policy=True, **BASE)
    _, result = step_once(small_model_dir, config, groups)
    assert result.violation is None
    assert result.stats["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5, rel=1e-5)
    # TIS weights exp(0.5) = 1.65 on the stale group, 1 elsewhere
    assert result.stats["is_weight_max"] == pytest.approx(1.6487, rel=1e-3)


def test_bf16_autocast_trains_close_to_fp32(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=False)
    _, fp32 = step_once(small_model_dir, TrainConfig(**BASE), groups)
    _, bf16 = step_once(small_model_dir, TrainConfig(dtype="bfloat16", **BASE), groups)
    assert 0 < bf16.stats["train_rollout_logprob_abs_diff_max"] < 0.1
    assert bf16.stats["entropy"] == pytest.approx(fp32.stats["entropy"], rel=0.02)


def test_sft_loss_is_the_token_mean_nll_of_loss_masked_tokens(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=False)
    samples = [s for g in groups for s in g]
    nll = [-lp for s in samples for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m]
    _, result = step_once(small_model_dir, TrainConfig(loss={"kind": "sft"}, optimizer={"lr": 1e-3}), groups)
    assert result.stats["sft_loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert result.stats["loss"] == pytest.approx(result.stats["sft_loss"], rel=1e-6)


def test_kl_to_the_frozen_reference_is_zero_first_then_positive(small_model_dir: Path) -> None:
    groups = make_samples(small_model_dir, deterministic=False)
    config = TrainConfig(loss={"kl_coef": 0.5, "kl_estimator": "k3"}, optimizer={"lr": 5e-2})
    backend = load_policy(small_model_dir, config)
    plan = assemble(groups, [0, 0], config, trainer_version=0, world_size=1).plan
    first = run_step(backend, plan, config)
    second = run_step(backend, StepPlan(plan.micro_batches, plan.global_num_tokens, plan.global_num_seqs, 1), config)
    assert first.stats["kl"] == pytest.approx(0.0, abs=1e-9)
    assert second.stats["kl"] > 1e-5
