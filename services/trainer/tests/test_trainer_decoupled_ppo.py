"""Decoupled PPO on hand-computed tensors: for each valid (old_logprobs, correction) pair the PPO ratio, the clip,
the importance weight and the per-token policy-gradient loss; the pairs that would correct the rollout mismatch
twice are refused (by the recipe, by the trainer's settings and by the loss itself).

Three loss tokens of one sequence, advantages A = (1, -1, 1), clip 0.2 / 0.2:
    lp (pi_theta)  = (-0.5, -1.0, -1.75)
    pi_old         = (-0.6, -0.7, -2.0 )     lp - pi_old = ( 0.1, -0.3,  0.25)
    mu (rollout)   = (-1.4, -0.9, -1.2 )     pi_old - mu = ( 0.8,  0.2, -0.8 )    lp - mu = (0.9, -0.1, -0.55)
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from miles.common.jobspec.trainer import TrainConfig
from miles.trainer.microbatch import PolicyGradient, policy_gradient_loss
from miles.trainer.settings import TrainerSettings
from miles.trainer.stats import StepStats

LOGPROBS = [-0.5, -1.0, -1.75]
PROXIMAL = [-0.6, -0.7, -2.0]
ROLLOUT = [-1.4, -0.9, -1.2]
ADVANTAGES = [1.0, -1.0, 1.0]
e = math.exp

# old_logprobs = train: ratio exp(lp - pi_old) = (e^0.1, e^-0.3, e^0.25); token 1 (A < 0, ratio < 0.8) and token 2
# (A > 0, ratio > 1.2) take the clipped branch.
TRAIN_RATIO = [e(0.1), e(-0.3), e(0.25)]
TRAIN_PPO = [-e(0.1), 0.8, -1.2]
TRAIN_CLIPPED = [0.0, 1.0, 1.0]
# old_logprobs = rollout: ratio exp(lp - mu) = (e^0.9, e^-0.1, e^-0.55); only token 0 (A > 0, ratio > 1.2) clips.
ROLLOUT_RATIO = [e(0.9), e(-0.1), e(-0.55)]
ROLLOUT_PPO = [-1.2, e(-0.1), -e(-0.55)]
ROLLOUT_CLIPPED = [1.0, 0.0, 0.0]
# pi_old / mu = (e^0.8 = 2.23, e^0.2 = 1.22, e^-0.8 = 0.45)
TIS_WEIGHTS = [2.0, e(0.2), 0.5]  # clamp to [0.5, 2]
MIS_WEIGHTS = [1.5, e(0.2), e(-0.8)]  # token level, truncate at 1.5 (no lower bound when truncating)

CASES = {
    "train+none": ({"old_logprobs": "train"}, {"mode": "none"}, TRAIN_RATIO, TRAIN_PPO, TRAIN_CLIPPED, [1.0] * 3),
    "train+tis": (
        {"old_logprobs": "train"},
        {"mode": "tis", "tis_lower": 0.5, "tis_upper": 2.0},
        TRAIN_RATIO,
        TRAIN_PPO,
        TRAIN_CLIPPED,
        TIS_WEIGHTS,
    ),
    "train+mis": (
        {"old_logprobs": "train"},
        {"mode": "mis", "mis_level": "token", "mis_mode": "truncate", "mis_upper": 1.5},
        TRAIN_RATIO,
        TRAIN_PPO,
        TRAIN_CLIPPED,
        MIS_WEIGHTS,
    ),
    "rollout+none": (
        {"old_logprobs": "rollout"},
        {"mode": "none"},
        ROLLOUT_RATIO,
        ROLLOUT_PPO,
        ROLLOUT_CLIPPED,
        [1.0] * 3,
    ),
}


def _run(config: TrainConfig, logprobs: torch.Tensor | None = None) -> tuple[PolicyGradient, StepStats]:
    stats = StepStats()
    terms = policy_gradient_loss(
        torch.tensor(LOGPROBS) if logprobs is None else logprobs,
        torch.tensor(PROXIMAL),
        torch.tensor(ROLLOUT),
        torch.tensor(ADVANTAGES),
        torch.ones(3),
        torch.zeros(3, dtype=torch.long),
        config,
        stats,
    )
    return terms, stats


@pytest.mark.parametrize("case", list(CASES))
def test_per_token_policy_gradient_loss_and_weights_of_each_valid_combination(case: str) -> None:
    loss, correction, ratio, ppo, clipped, weights = CASES[case]
    config = TrainConfig(loss=loss, correction=correction)
    assert config.recipe_problems() == []
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    terms, stats = _run(config, logprobs)
    assert terms.ratio.tolist() == pytest.approx(ratio, rel=1e-6)
    assert terms.clipped.tolist() == clipped
    assert terms.weights.tolist() == pytest.approx(weights, rel=1e-6)
    assert terms.keep.tolist() == [1.0, 1.0, 1.0]
    expected = [w * p for w, p in zip(weights, ppo, strict=True)]
    assert terms.loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert terms.loss.requires_grad and not terms.weights.requires_grad
    # the mismatch statistics are pi_old vs mu whatever the denominator
    assert stats.result()["is_ratio_max"] == pytest.approx(e(0.8), rel=1e-6)


def test_train_with_tis_weights_are_the_clamped_proximal_over_rollout_ratio() -> None:
    config = TrainConfig(correction={"mode": "tis", "tis_lower": 0.5, "tis_upper": 2.0})
    terms, _ = _run(config)
    proximal, rollout, logprobs = torch.tensor(PROXIMAL), torch.tensor(ROLLOUT), torch.tensor(LOGPROBS)
    assert torch.allclose(terms.weights, torch.clamp(torch.exp(proximal - rollout), 0.5, 2.0))
    assert torch.allclose(terms.ratio, torch.exp(logprobs - proximal))


def test_rollout_with_no_correction_has_ratio_over_mu_and_unit_weights() -> None:
    config = TrainConfig(loss={"old_logprobs": "rollout"}, correction={"mode": "none"})
    terms, _ = _run(config)
    assert torch.allclose(terms.ratio, torch.exp(torch.tensor(LOGPROBS) - torch.tensor(ROLLOUT)))
    assert terms.weights.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_denominator_with_a_correction_is_refused_everywhere(mode: str) -> None:
    config = TrainConfig(loss={"old_logprobs": "rollout"}, correction={"mode": mode})
    ((field, why),) = config.recipe_problems()
    assert field == "train.correction.mode"
    assert "train.loss.old_logprobs" in why and f"'{mode}'" in why and "twice" in why
    with pytest.raises(ValidationError, match=r"train\.correction\.mode.*train\.loss\.old_logprobs"):
        TrainerSettings(train=config)
    with pytest.raises(ValueError, match="corrected twice"):
        _run(config)


def test_sft_recipes_have_no_correction_problem() -> None:
    config = TrainConfig(loss={"kind": "sft", "old_logprobs": "rollout"})
    assert config.recipe_problems() == []
