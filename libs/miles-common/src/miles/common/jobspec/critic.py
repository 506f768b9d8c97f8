"""PPO with a learned critic: the `train.critic` section, used with `train.loss.advantage_estimator: gae`.

The trainer (torch backend) puts a value head on the policy: one linear layer from the policy's final-normed
hidden state at each response token's prefix to a scalar V(s_t) (the detached hidden state unless `shared_trunk`),
trained with PPO's clipped value loss beside the policy-gradient loss, and replaces the group-baseline advantages
by GAE(gamma, lambda) over the loss-masked (model) tokens of each sample, with the sample's reward on its last
model token. The formulas live in `miles.trainer.critic`; the trainer README has the whole recipe and its limits.

It lives in miles.common.jobspec (not in the trainer) so that the controller can validate a job spec without
importing torch.
"""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    """`train.critic`: the value head, its loss and GAE. Only with `loss.advantage_estimator: gae` (and the other
    way round: `TrainConfig.recipe_problems`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    gamma: float = Field(default=1.0, ge=0, le=1)
    """GAE discount per model token: delta_t = r_t + gamma * V(s_t+1) - V(s_t). 1 (the default) does not discount
    a terminal reward over a long response."""

    lam: float = Field(default=1.0, ge=0, le=1, validation_alias=AliasChoices("lam", "lambda"))
    """GAE lambda (also accepted as `lambda` in a job spec): A_t = delta_t + gamma * lam * A_t+1; 0 gives the
    one-step TD residual. 1 (the default, with gamma 1): A_t = R - V(s_t), the terminal reward against a learned
    per-token baseline. Below 1 the reward reaches a token only through lam^(tokens to the end) and the critic's
    values, so with a critic that has not learned yet the early tokens of a long response get small advantages,
    which whitening turns negative: on the demo task, lam 0.95 with the zero-initialised head sent the reward to 0
    for two steps before it recovered. Lower it once the critic explains the returns (value_explained_variance)."""

    value_clip: float | None = Field(default=0.2, gt=0)
    """PPO value clipping: the value loss is max((V - R)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2)
    / 2 with V_old the values before the trainer step's first update; None: the plain (V - R)^2 / 2. Like the policy
    clip, it binds only from the second optimizer step of a trainer step on (`ppo_epochs` or `num_minibatches` > 1).
    In the units of the reward."""

    value_loss_coef: float = Field(default=0.5, gt=0)
    """Weight of the value loss in the total loss. With `shared_trunk` it sets how much the value loss shapes the
    policy's weights; without, it only scales the head's own gradient (which AdamW normalises)."""

    shared_trunk: bool = False
    """Whether the value loss's gradient flows into the policy's weights the head sits on (a shared actor-critic
    trunk: more capacity for the critic, but the critic's regression then moves the policy). Off: the head learns
    on the policy's detached hidden states, a linear critic on the policy's features that never moves the policy.
    On the demo task (lr 1e-3) a shared trunk did worse in the runs measured: with value_loss_coef 0.5 (and lam
    0.95) the reward fell to 0 for good after 3 steps; with 0.1 it did not rise over 10 steps."""

    lr: float | None = Field(default=None, gt=0)
    """Learning rate of the value head's own parameters (weight and bias; its own AdamW parameter group, following
    the same warm-up and schedule); None: `optimizer.lr`. The head starts at zero, so a policy learning rate meant
    for a pretrained model (1e-6) moves it slowly: something like 1e-3 is a better start."""

    whiten_advantages: bool = True
    """Whiten the GAE advantages over every loss token of the trainer step's batch (per role, as
    `reinforce_pp_baseline` does): A <- (A - mean) / (std + loss.advantage_eps). Off: the raw GAE advantages."""
