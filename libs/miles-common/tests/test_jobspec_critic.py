"""PPO with a critic in the job spec (`train.critic`, miles.common.jobspec.critic): its defaults and bounds, the
`lambda` alias, the (field, why) of `recipe_problems` for a critic that cannot work with the rest of the recipe,
and the submission-time refusal of a critic on the megatron backend (`JobSpec.placement_problems`)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from miles.common.jobspec.critic import CriticConfig
from miles.common.jobspec.job import JobSpec
from miles.common.jobspec.trainer import TrainConfig

GAE = {"loss": {"advantage_estimator": "gae"}}


def test_defaults_and_the_lambda_alias() -> None:
    critic = CriticConfig()
    assert (critic.gamma, critic.lam, critic.value_clip, critic.lr, critic.whiten_advantages) == (
        1.0,
        1.0,
        0.2,
        None,
        True,
    )
    assert CriticConfig.model_validate({"lambda": 0.9}).lam == 0.9
    assert CriticConfig.model_validate({"lam": 0.8}).lam == 0.8
    assert TrainConfig.model_validate({**GAE, "critic": {"lambda": 0.5}}).recipe_problems() == []


@pytest.mark.parametrize(
    "raw", [{"gamma": 1.5}, {"lam": -0.1}, {"value_clip": 0}, {"value_loss_coef": 0}, {"lr": 0}, {"lamda": 0.9}]
)
def test_out_of_range_or_unknown_critic_fields_are_validation_errors(raw: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CriticConfig.model_validate(raw)


@pytest.mark.parametrize(
    ("train", "said"),
    [
        (GAE, "needs a value head: add train.critic"),
        ({"critic": {}}, "only with train.loss.advantage_estimator 'gae' (got 'grpo')"),
        ({"loss": {"kind": "sft"}, "critic": {}}, "'sft' trains no critic"),
        ({**GAE, "critic": {}, "lora": {"rank": 4}}, "not built with train.lora"),
        ({**GAE, "critic": {}, "distillation": {"teacher_pool": "teacher"}}, "train.distillation"),
    ],
)
def test_a_critic_that_cannot_work_with_the_recipe_is_a_recipe_problem_on_train_critic(
    train: dict[str, Any], said: str
) -> None:
    ((field, why),) = TrainConfig.model_validate(train).recipe_problems()
    assert field == "train.critic" and said in why


def job(backend: str) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "ppo",
            "model": {"path": "/models/tiny", "family": "qwen3"},
            "rollout": {"dataset": {"path": "d.jsonl"}, "agent": {"function": "a:agent"}},
            "train": {**GAE, "critic": {}, "num_steps": 2},
            "resources": {"trainer": {"backend": backend}},
        }
    )


def test_a_critic_on_the_megatron_backend_is_refused_at_submission() -> None:
    ((field, why),) = job("megatron").placement_problems()
    assert field == "train.critic" and "torch trainer backend" in why
    assert job("torch").placement_problems() == []
