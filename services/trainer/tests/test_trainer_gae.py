"""GAE, value targets, whitening, explained variance and PPO's clipped value loss (miles.trainer.critic), pinned
against values computed by hand on small tensors (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest
import torch

from miles.common.jobspec.critic import CriticConfig
from miles.trainer.batch import TrainSample
from miles.trainer.critic import clipped_value_loss, critic_targets, gae, micro_batch_gae
from miles.trainer.stats import StepStats


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def sample(mask: list[int], reward: float, *, trainable: bool = True, role: str | None = None) -> TrainSample:
    n = len(mask)
    return TrainSample("g", "s", 0, [1] * (n + 1), 1, mask, [0.0] * n, reward, trainable, 0, 0, role=role)


def test_gae_over_four_model_tokens_with_gamma_and_lambda() -> None:
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72), V = .5 .4 .3 .2, V_4 = 0, reward 1 on the last token:
    # delta_3 = 1 - .2 = .8 ; delta_2 = .9*.2 - .3 = -.12 ; delta_1 = .9*.3 - .4 = -.13 ; delta_0 = .9*.4 - .5 = -.14
    # A_3 = .8 ; A_2 = -.12 + .72*.8 = .456 ; A_1 = -.13 + .72*.456 = .19832 ; A_0 = -.14 + .72*.19832 = .0027904
    advantages, returns = gae(t(0.5, 0.4, 0.3, 0.2), t(1, 1, 1, 1), 1.0, gamma=0.9, lam=0.8)
    assert torch.allclose(advantages, t(0.0027904, 0.19832, 0.456, 0.8), atol=1e-12)
    # R = A + V
    assert torch.allclose(returns, t(0.5027904, 0.59832, 0.756, 1.0), atol=1e-12)


def test_gae_steps_over_tokens_outside_the_loss_mask() -> None:
    # A tool token between two model tokens and one after the last: their values (9, 7) are never read; the model
    # tokens are V = .5 .4 .2 and the reward 2 sits on the last model token (index 3, not the last response token).
    # delta_2 = 2 - .2 = 1.8 ; delta_1 = .9*.2 - .4 = -.22 ; delta_0 = .9*.4 - .5 = -.14
    # A_2 = 1.8 ; A_1 = -.22 + .72*1.8 = 1.076 ; A_0 = -.14 + .72*1.076 = .63472 ; masked tokens: 0
    advantages, returns = gae(t(0.5, 9.0, 0.4, 0.2, 7.0), t(1, 0, 1, 1, 0), 2.0, gamma=0.9, lam=0.8)
    assert torch.allclose(advantages, t(0.63472, 0.0, 1.076, 1.8, 0.0), atol=1e-12)
    assert torch.allclose(returns, t(1.13472, 0.0, 1.476, 2.0, 0.0), atol=1e-12)


def test_gae_at_lambda_one_is_the_return_minus_the_value_and_at_zero_the_td_residual() -> None:
    values = t(0.25, -0.5, 1.0)
    # gamma 1, lam 1: A_t = R - V_t
    advantages, returns = gae(values, t(1, 1, 1), 3.0, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, t(2.75, 3.5, 2.0)) and torch.allclose(returns, t(3.0, 3.0, 3.0))
    # gamma .5, lam 0: A_t = delta_t = r_t + .5 V_t+1 - V_t = (-.25 - .25, .5 + .5, 3 - 1)
    advantages, _ = gae(values, t(1, 1, 1), 3.0, gamma=0.5, lam=0.0)
    assert torch.allclose(advantages, t(-0.5, 1.0, 2.0))


def test_a_sample_without_model_tokens_gets_nothing() -> None:
    advantages, returns = gae(t(0.3, 0.4), t(0, 0), 1.0, gamma=1.0, lam=0.95)
    assert advantages.tolist() == [0.0, 0.0] and returns.tolist() == [0.0, 0.0]


def test_micro_batch_gae_runs_each_sample_on_its_own_values() -> None:
    # Three samples packed: (2 tokens, reward 1), (1 token, not trainable), (3 tokens with a tool token, reward -1).
    config = CriticConfig(gamma=0.9, lam=0.8)
    samples = [sample([1, 1], 1.0), sample([1], 5.0, trainable=False), sample([1, 0, 1], -1.0)]
    values = t(0.5, 0.1, 0.7, 0.2, 3.0, -0.4)
    advantages, returns = micro_batch_gae(samples, values, config)
    # sample 0: delta_1 = 1 - .1 = .9 ; delta_0 = .9*.1 - .5 = -.41 ; A = (-.41 + .72*.9, .9) = (.238, .9)
    # sample 1: not trained on: 0
    # sample 2: model tokens V = .2, -.4 ; delta_1 = -1 + .4 = -.6 ; delta_0 = .9*(-.4) - .2 = -.56 ;
    #           A = (-.56 + .72*(-.6), 0, -.6) = (-.992, 0, -.6) ; R = A + V = (-.792, 0, -1)
    assert torch.allclose(advantages, t(0.238, 0.9, 0.0, -0.992, 0.0, -0.6), atol=1e-12)
    assert torch.allclose(returns, t(0.738, 1.0, 0.0, -0.792, 0.0, -1.0), atol=1e-12)
    with pytest.raises(ValueError, match="disagree"):
        micro_batch_gae(samples, values[:5], config)


def test_value_clipping_takes_the_pessimistic_branch_and_stops_the_gradient_there() -> None:
    # clip .2 around V_old = .5 (V clipped to [.3, .7]):
    # V=1,  R=2:  (1-2)^2 = 1    vs (.7-2)^2 = 1.69  -> 1.69 / 2 = .845, clipped (no gradient: the clamp saturates)
    # V=0,  R=-1: (0+1)^2 = 1    vs (.3+1)^2 = 1.69  -> .845, clipped
    # V=.5, R=0:  .25 vs .25                        -> .125, not clipped (equal)
    # V=.3, R=1:  inside the clip: .49              -> .245, not clipped
    # V=1,  R=0:  (1-0)^2 = 1    vs (.7-0)^2 = .49   -> .5, the unclipped branch (gradient V - R = 1)
    values = t(1.0, 0.0, 0.5, 0.3, 1.0).requires_grad_(True)
    old, returns = t(0.5, 0.5, 0.5, 0.5, 0.5), t(2.0, -1.0, 0.0, 1.0, 0.0)
    terms = clipped_value_loss(values, old, returns, clip=0.2)
    assert torch.allclose(terms.loss, t(0.845, 0.845, 0.125, 0.245, 0.5))
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    terms.loss.sum().backward()
    assert values.grad is not None
    # d/dV of (V - R)^2 / 2 is V - R on unclipped tokens; 0 where the clipped branch won
    assert torch.allclose(values.grad, t(0.0, 0.0, 0.5, -0.7, 1.0))


def test_without_value_clip_the_loss_is_the_half_squared_error() -> None:
    terms = clipped_value_loss(t(1.0, 0.0), t(0.5, 0.5), t(2.0, -1.0), clip=None)
    assert torch.allclose(terms.loss, t(0.5, 0.5)) and terms.clipped.tolist() == [0.0, 0.0]


def identity(stats: StepStats) -> StepStats:
    return stats


def test_targets_are_whitened_over_every_micro_batch_and_explained_variance_is_over_the_batch() -> None:
    # gamma = lam = 1: A = R - V. Micro-batch a: V = .5 .5, reward 1 -> A = .5 .5, R = 1 1.
    # Micro-batch b: V = .25 .25, reward 0 -> A = -.25 -.25, R = 0 0.
    # Over the 4 tokens: mean A = .125, E[A^2] = (2*.25 + 2*.0625)/4 = .15625, var = .140625, std = .375
    # -> whitened: (.5 - .125)/.375 = 1, (-.25 - .125)/.375 = -1.
    # Explained variance: residual R - V = A (var .140625), Var(R) = .25 -> 1 - .140625/.25 = .4375.
    config = CriticConfig(gamma=1.0, lam=1.0)
    micro = {"a": [sample([1, 1], 1.0)], "b": [sample([1, 1], 0.0)]}
    values = {"a": t(0.5, 0.5), "b": t(0.25, 0.25)}
    targets, stats = critic_targets(micro, values, config, eps=1e-12, merge=identity)
    assert torch.allclose(targets["a"].advantages, t(1.0, 1.0)) and torch.allclose(targets["b"].advantages, t(-1, -1))
    assert torch.allclose(targets["a"].returns, t(1.0, 1.0)) and torch.allclose(targets["b"].returns, t(0.0, 0.0))
    assert torch.equal(targets["b"].old_values, values["b"])
    assert stats["value_explained_variance"] == pytest.approx(0.4375)
    assert stats["value_mean"] == pytest.approx(0.375) and stats["return_mean"] == pytest.approx(0.5)
    assert stats["advantage_mean"] == pytest.approx(0.0) and stats["advantage_std"] == pytest.approx(1.0)
    assert (stats["advantage_min"], stats["advantage_max"]) == pytest.approx((-1.0, 1.0))

    raw, _ = critic_targets(
        micro, values, config.model_copy(update={"whiten_advantages": False}), eps=1e-12, merge=identity
    )
    assert torch.allclose(raw["a"].advantages, t(0.5, 0.5)) and torch.allclose(raw["b"].advantages, t(-0.25, -0.25))


def test_each_role_is_whitened_on_its_own_and_masked_tokens_stay_zero() -> None:
    # Role x: A = 1, 3 (gamma = lam = 1, V = 0, rewards 1 and 3) -> mean 2, std 1 -> -1, 1.
    # Role y: A = 10, 10 (a masked token between them, 0) and 20 -> mean 40/3, population std 4.714: -.707, 1.414.
    config = CriticConfig(gamma=1.0, lam=1.0)
    micro = {0: [sample([1], 1.0, role="x"), sample([1, 0, 1], 10.0, role="y")], 1: [sample([1], 3.0, role="x")]}
    micro[1].append(sample([1], 20.0, role="y"))
    values = {0: t(0.0, 0.0, 5.0, 0.0), 1: t(0.0, 0.0)}
    targets, _ = critic_targets(micro, values, config, eps=0.0, merge=identity)
    y = torch.tensor([10.0, 10.0, 20.0], dtype=torch.float64)
    y_white = (y - y.mean()) / y.std(unbiased=False)
    assert torch.allclose(targets[0].advantages, torch.stack([t(-1.0)[0], y_white[0], t(0.0)[0], y_white[1]]))
    assert torch.allclose(targets[1].advantages, torch.stack([t(1.0)[0], y_white[2]]))
