"""The training recipe (`miles.common.jobspec.trainer.TrainConfig`): the defaults of the trust-region and
dynamic-sampling fields, their bounds, and `recipe_problems`, which reports (field, why) for a recipe that
pydantic accepts but that must be refused: the rollout mismatch corrected twice."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from miles.common.jobspec.trainer import TrainConfig


def test_defaults_run_one_optimizer_step_per_batch_with_dynamic_sampling() -> None:
    config = TrainConfig()
    assert (config.num_minibatches, config.ppo_epochs, config.dynamic_sampling) == (1, 1, True)
    assert config.recipe_problems() == []


@pytest.mark.parametrize("field", ["num_minibatches", "ppo_epochs"])
def test_minibatches_and_epochs_are_at_least_one(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        TrainConfig.model_validate({field: 0})


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_denominator_with_a_correction_is_a_recipe_problem_not_a_validation_error(mode: str) -> None:
    config = TrainConfig.model_validate({"loss": {"old_logprobs": "rollout"}, "correction": {"mode": mode}})
    ((field, why),) = config.recipe_problems()
    assert field == "train.correction.mode"
    assert "train.loss.old_logprobs 'rollout'" in why and f"train.correction.mode '{mode}'" in why


@pytest.mark.parametrize(
    ("old_logprobs", "mode"), [("rollout", "none"), ("train", "none"), ("train", "tis"), ("train", "mis")]
)
def test_each_single_correction_is_accepted(old_logprobs: str, mode: str) -> None:
    config = TrainConfig.model_validate({"loss": {"old_logprobs": old_logprobs}, "correction": {"mode": mode}})
    assert config.recipe_problems() == []


def test_async_masks_stale_spans_by_default_and_sync_always_drops() -> None:
    assert (TrainConfig().stale_policy, TrainConfig().effective_stale_policy) == ("mask", "mask")
    assert TrainConfig(stale_policy="drop").effective_stale_policy == "drop"
    assert TrainConfig(mode="sync").effective_stale_policy == "drop"
    with pytest.raises(ValidationError, match="stale_policy"):
        TrainConfig.model_validate({"stale_policy": "requeue"})
