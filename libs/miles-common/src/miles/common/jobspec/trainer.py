"""The training recipe: algorithm and hyper-parameters of one job, as typed, documented pydantic models.

`TrainConfig` is the `train` section of the trainer's settings (environment `MILES_TRAINER_TRAIN__...`, or the
job's trainer section in the JSON file named by `MILES_TRAINER_CONFIG_FILE`, which the controller writes). Every
field states its unit and default; the defaults follow Miles (TIS clamp [0, 2], PPO eps 0.2) where Miles has one.

It lives in miles.common.jobspec (not in the trainer) so that the controller can validate a whole job spec
without importing torch. Formulas live in the trainer modules that compute them (`miles.trainer.advantages`,
`losses`, `corrections`) and in the trainer README.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles.common.jobspec.critic import CriticConfig
from miles.common.jobspec.distillation import DistillationConfig

AdvantageEstimator = Literal["grpo", "dr_grpo", "reinforce_pp_baseline", "gae"]
Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
KlEstimator = Literal["k1", "k2", "k3"]
CorrectionMode = Literal["none", "tis", "mis"]
MisLevel = Literal["token", "sequence", "geometric"]
MisMode = Literal["truncate", "clip", "mask"]


class Section(BaseModel):
    """Base of every nested settings section: unknown keys refused, field docstrings kept, immutable."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class LossConfig(Section):
    """Which objective is optimised and how per-token terms become one number."""

    kind: Literal["policy_gradient", "sft"] = "policy_gradient"
    """`policy_gradient`: PPO-clipped policy gradient with advantages (RL jobs). `sft`: negative log-likelihood
    of the loss-masked tokens (SFT jobs; rewards and advantages are ignored)."""

    advantage_estimator: AdvantageEstimator = "grpo"
    """`grpo`: (r - mean_group) / (std_group + eps). `dr_grpo`: r - mean_group (no std division; pair it with
    aggregation `seq_mean_token_sum` and `token_sum_divisor` = max response tokens). `reinforce_pp_baseline`:
    r - mean_group, then whitened over every valid token of the batch (REINFORCE++ with a group baseline).
    `gae`: PPO with a learned critic (`TrainConfig.critic`, required): per-token GAE(gamma, lambda) from a value
    head's predictions, computed in the trainer step (torch backend only)."""

    advantage_eps: float = Field(default=1e-6, gt=0)
    """Added to the standard deviation before dividing (grpo, reinforce_pp_baseline)."""

    aggregation: Aggregation = "token_mean"
    """How per-token losses are reduced over the global batch: `token_mean` (sum / valid tokens),
    `seq_mean_token_mean` (mean over sequences of each sequence's token mean), `seq_mean_token_sum` (mean over
    sequences of each sequence's token sum / token_sum_divisor). Independent of the micro-batch split."""

    token_sum_divisor: float = Field(default=1.0, gt=0)
    """Constant dividing each sequence's token sum in `seq_mean_token_sum` (Dr.GRPO: the max response length)."""

    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO: the ratio is clipped below at 1 - clip_low."""

    clip_high: float = Field(default=0.2, ge=0)
    """PPO: the ratio is clipped above at 1 + clip_high (DAPO clip-higher: e.g. 0.28 > clip_low)."""

    dual_clip_c: float | None = Field(default=None, gt=1)
    """Dual-clip PPO: for negative advantages the loss is capped at -c * A (c > 1); None disables."""

    old_logprobs: Literal["train", "rollout"] = "train"
    """Denominator of the PPO ratio. `train` (decoupled PPO): the proximal policy pi_old, the trainer's own
    logprobs before the first update of the step; the ratio pi_theta / pi_old is clipped and the behaviour
    policy's mismatch pi_old / mu is corrected once, by `correction` (TIS/MIS). The ratio is 1 on the first
    update, so the clip acts only from the second optimizer step of a trainer step on (`ppo_epochs` or
    `num_minibatches` > 1). `rollout`: the engine's logprobs mu (the ratio pi_theta / mu itself carries the
    off-policyness and clipping acts on it); `correction.mode` must then be `none`, or the mismatch would be
    corrected twice (see `TrainConfig.recipe_problems`)."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the frozen reference (the initial weights); 0 builds no reference model."""

    kl_estimator: KlEstimator = "k3"
    """KL estimator per token with d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d."""

    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss)."""

    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the rollouts: logprobs are log_softmax(logits / temperature), as the engine
    reports them."""


class CorrectionConfig(Section):
    """Off-policy (train/inference mismatch) correction of the policy-gradient term: TIS or MIS."""

    mode: CorrectionMode = "tis"
    """`tis`: token weights exp(train_logp - rollout_logp) clamped to [tis_lower, tis_upper], with train_logp the
    proximal policy pi_old (the trainer's logprobs before the step's first update). `mis`: the masked/truncated
    importance sampling below. `none`: no weights (mismatch metrics are still reported); required with
    loss.old_logprobs `rollout`, whose PPO ratio already corrects for the rollout policy."""

    tis_lower: float = Field(default=0.0, ge=0)
    """TIS clamp lower bound (Miles default 0)."""

    tis_upper: float = Field(default=2.0, gt=0)
    """TIS clamp upper bound (Miles default 2)."""

    mis_level: MisLevel = "token"
    """MIS: per `token`, per `sequence` (exp of the masked sum of log-ratios) or `geometric` (exp of their mean)."""

    mis_mode: MisMode = "truncate"
    """MIS: `truncate` caps the weight at mis_upper; `clip` clamps it to [mis_lower, mis_upper]; `mask` keeps the
    weight but drops tokens whose weight is outside [mis_lower, mis_upper]."""

    mis_upper: float = Field(default=2.0, gt=0)
    """MIS upper bound."""

    mis_lower: float | None = Field(default=None, ge=0)
    """MIS lower bound (None: 1 / mis_upper)."""

    rs_enabled: bool = False
    """Rejection sampling: drop tokens whose ratio at `rs_level` lies outside [rs_lower, rs_upper]."""

    rs_level: MisLevel = "token"
    """Level of the rejection ratio."""

    rs_upper: float | None = Field(default=None, gt=0)
    """Rejection upper bound (None: mis_upper)."""

    rs_lower: float | None = Field(default=None, ge=0)
    """Rejection lower bound (None: the MIS lower bound)."""

    rs_veto_threshold: float | None = Field(default=None, gt=0)
    """Veto: a sequence with any token ratio below this is dropped whole (Miles example: 1e-4); None disables."""

    log_ratio_clamp: float = Field(default=20.0, gt=0)
    """Log-ratios are clamped to +-this before exp (as Miles), so a wild token cannot overflow."""

    @property
    def resolved_mis_lower(self) -> float:
        return self.mis_lower if self.mis_lower is not None else 1.0 / self.mis_upper


class OptimizerConfig(Section):
    """AdamW and its learning-rate schedule (one scheduler step per trainer step, i.e. per published version,
    whatever the number of optimizer steps in it)."""

    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""

    grad_clip_norm: float | None = Field(default=1.0, gt=0)
    """Global gradient-norm clip; None disables clipping (the norm is still reported)."""

    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up from 0 to lr over this many trainer steps."""

    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant, linear decay or cosine decay to min_lr_ratio * lr at num_steps."""

    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of lr (linear and cosine)."""


class LoraConfig(Section):
    """LoRA fine-tuning (torch backend only): the base weights stay frozen and only low-rank adapters
    W + (alpha / rank) * B @ A on the `target_modules` are trained (the `peft` library's LoRA). Target names are
    checked against the model when the trainer loads it; the megatron backend refuses LoRA."""

    rank: int = Field(default=8, ge=1)
    """LoRA rank r of every adapter (A is r x in_features, B is out_features x r)."""

    alpha: float = Field(default=16.0, gt=0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)."""

    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Last name component of every linear layer that gets an adapter (e.g. `q_proj` adapts the query projection
    of every layer). Non-empty, no duplicates; a name that matches no linear layer of the model is refused when
    the trainer loads it."""

    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training forwards. 0 keeps the trainer's logprobs exactly those of the
    merged weights the engines serve; above 0 the training forwards are stochastic (and strict_on_policy is
    refused)."""

    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(rank) instead of alpha / rank."""

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if not names:
            raise ValueError("target_modules must name at least one linear layer (e.g. ['q_proj', 'v_proj'])")
        if any(not name or "." in name for name in names):
            raise ValueError(f"target_modules must be plain layer names without dots (got {names})")
        if len(set(names)) != len(names):
            raise ValueError(f"target_modules has duplicates: {names}")
        return names

    @property
    def scaling(self) -> float:
        """The factor of B @ A: alpha / rank, or alpha / sqrt(rank) with use_rslora."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


class TrainConfig(Section):
    """One job's training recipe."""

    loss: LossConfig = LossConfig()
    correction: CorrectionConfig = CorrectionConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    lora: LoraConfig | None = None
    """LoRA fine-tuning (torch backend only); None trains every weight."""
    distillation: DistillationConfig | None = None
    """On-policy distillation from a teacher pool (miles.common.jobspec.distillation); None: the reward alone."""
    critic: CriticConfig | None = None
    """PPO with a learned critic (miles.common.jobspec.critic): a value head trained beside the policy and GAE
    advantages; required by, and only with, loss.advantage_estimator `gae`. None: no critic."""

    mode: Literal["sync", "async"] = "async"
    """`sync`: step k trains only on data generated by weight version k (max staleness 0). `async`: data up to
    max_staleness versions old is accepted."""

    max_staleness: int = Field(default=1, ge=1)
    """async: largest staleness of a trained token = trainer version - the version that sampled it (each turn of
    an episode is a span with its own version; see stale_policy for a group whose spans straddle the bound)."""

    stale_policy: Literal["mask", "drop"] = "mask"
    """async: what becomes of a group whose oldest span is over max_staleness when the trainer pulls it. `mask`
    (partial rollout): a long episode that ran on across weight updates keeps its fresh turns: the trainer masks
    every span older than the bound out of the loss (they stay context) and trains the rest; only a group with no
    span within the bound is dropped. `drop`: the whole group is dropped, which throws its generation away and
    biases training towards short episodes (`make bench-async`, drain updates: 2.1-2.4x the barrier baseline's
    samples/s with drop, 2.7 with mask). Sync mode always drops (it trains version k on version k's data only)."""

    batch_size_groups: int = Field(default=8, ge=1)
    """Groups per trainer step (the global batch, one published weight version); with the defaults
    (num_minibatches = ppo_epochs = 1) gradients of all its micro-batches accumulate into one optimizer step."""

    num_minibatches: int = Field(default=1, ge=1)
    """Minibatches a trainer step's batch is split into (samples split evenly, in order, after advantages are
    computed on the whole batch); one optimizer step per minibatch and epoch, each normalised by its own
    minibatch's token/sequence counts."""

    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over the batch per trainer step. A trainer step runs ppo_epochs * num_minibatches optimizer steps
    (minus those without signal) and advances the LR schedule once; pi_old and the TIS/MIS weights stay those
    of the weights before its first update."""

    dynamic_sampling: bool = True
    """policy_gradient only (DAPO dynamic sampling): a group whose trainable samples all have the same reward
    (fewer than two trainable samples included) carries no advantage; the trainer discards it (nack with
    discard, reason `zero_signal`) and keeps pulling until the batch holds batch_size_groups informative groups.
    Off: such groups are trained (their advantage is 0) and only counted. Never discards with the `gae` estimator
    (the critic's baseline gives equal-reward groups advantages too) or with distillation."""

    routing_replay: bool | None = None
    """Rollout Routing Replay (R3), for mixture-of-experts models: the engine records the experts it routed each
    token to, the samples carry them (`Sample.rollout_routed_experts`) and the trainer's forward uses them instead
    of its own top-k choice (the router still gets its gradient, through the recorded experts' probabilities).
    None (the default): on for MoE models. On, a group lacking routing is refused (nack, reason
    `missing_routing`), never trained without it. `false`: the trainer routes by itself, and its logprobs drift
    from the rollout's wherever a top-k choice flips (e.g. after a weight update in async mode). Dense models
    have no routing; `true` with a dense model is refused at start."""

    micro_batch_max_tokens: int = Field(default=8192, ge=2)
    """Token budget of one micro-batch: sequences are packed (first-fit decreasing) up to this many tokens; a
    longer sequence runs alone."""

    num_steps: int = Field(default=0, ge=0)
    """Trainer steps of the job (one published weight version each; the trainer then reports FINISHED); 0 means
    run until stopped. Steps skipped for lack of signal do not count."""

    checkpoint_interval_steps: int = Field(default=1, ge=1)
    """A durable checkpoint every this many steps (and at the last step and on Stop/Checkpoint). Pulled groups
    are acked only once a checkpoint containing their update is durable, so a larger interval means more
    groups held leased and more work redone after a crash."""

    keep_last_checkpoints: int = Field(default=2, ge=1)
    """Checkpoints kept; older ones are deleted after a new one is durable."""

    strict_on_policy: bool = False
    """Fail the step when data generated by the current weight version has a recomputed logprob that differs
    from its rollout logprob (needs the engine and the trainer in deterministic mode, fp32)."""

    deterministic: bool = False
    """Use miles.model's shape-invariant forward (torch backend): recomputed logprobs are bit-identical to a
    deterministic engine's. Slower (per-query attention); meant for small models and on-policy checks."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the forward: bfloat16 runs the forward under autocast with float32 master weights."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of storing them (less memory, ~1/3 more compute)."""

    seed: int = 0
    """Seed of the trainer's torch RNG (saved and restored with checkpoints)."""

    lease_s: float = Field(default=600.0, gt=0)
    """Lease of pulled groups; extended every lease_s / 3 while their update is not yet checkpointed."""

    pull_wait_s: float = Field(default=5.0, ge=0)
    """Long-poll of one PullBatch; the trainer keeps pulling until batch_size_groups valid groups are in hand."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.correction.tis_lower > self.correction.tis_upper:
            raise ValueError("correction.tis_lower must be <= correction.tis_upper")
        if self.correction.resolved_mis_lower > self.correction.mis_upper:
            raise ValueError("correction.mis_lower must be <= correction.mis_upper")
        return self

    def recipe_problems(self) -> list[tuple[str, str]]:
        """Semantic problems of a recipe whose fields are each valid: (field path from the job spec, why).

        Not pydantic errors, so that the controller can answer a submission with the field (HTTP 400) and the
        trainer can refuse the settings at start-up; empty when the recipe is consistent."""
        problems: list[tuple[str, str]] = []
        pg = self.loss.kind == "policy_gradient"
        if pg and self.loss.old_logprobs == "rollout" and self.correction.mode != "none":
            problems.append(
                (
                    "train.correction.mode",
                    f"train.loss.old_logprobs 'rollout' makes the PPO ratio pi_theta / mu (rollout logprobs), which "
                    f"already corrects for the behaviour policy; train.correction.mode '{self.correction.mode}' "
                    "would multiply by pi_old / mu again (the mismatch corrected twice). Use correction.mode 'none' "
                    "with old_logprobs 'rollout', or old_logprobs 'train' (decoupled PPO) with tis/mis.",
                )
            )
        problems += self._critic_problems()
        if self.lora is not None and self.lora.dropout > 0 and self.strict_on_policy:
            problems.append(
                (
                    "train.lora.dropout",
                    "train.strict_on_policy needs the trainer's logprobs to equal the served (merged) weights' "
                    "exactly, which LoRA dropout in the training forwards breaks; use train.lora.dropout 0",
                )
            )
        return problems

    def _critic_problems(self) -> list[tuple[str, str]]:
        """A critic section and the `gae` estimator go together, in a policy-gradient job without LoRA or
        distillation (neither is built with a value head)."""
        gae = self.loss.advantage_estimator == "gae"
        if self.critic is None:
            if gae and self.loss.kind == "policy_gradient":
                why = "train.loss.advantage_estimator 'gae' needs a value head: add train.critic ({}: the defaults)"
                return [("train.critic", why)]
            return []
        if self.loss.kind != "policy_gradient":
            return [("train.critic", f"train.loss.kind '{self.loss.kind}' trains no critic: remove train.critic")]
        if not gae:
            why = (
                f"train.critic is trained only with train.loss.advantage_estimator 'gae' (got "
                f"'{self.loss.advantage_estimator}'): set the estimator to 'gae' or remove train.critic"
            )
            return [("train.critic", why)]
        if self.lora is not None:
            return [("train.critic", "a critic is not built with train.lora (LoRA jobs train group baselines only)")]
        if self.distillation is not None:
            why = "train.distillation adds the task advantage before the step, where GAE needs the critic's values"
            return [("train.critic", why + ": use another estimator with distillation")]
        return []

    @property
    def discards_zero_signal(self) -> bool:
        """Dynamic sampling in force: never with distillation (the teacher's signal is per token, whatever the
        rewards) nor with `gae` (the critic's values give a group of equal rewards advantages too)."""
        per_token = self.distillation is not None or self.loss.advantage_estimator == "gae"
        return self.dynamic_sampling and self.loss.kind == "policy_gradient" and not per_token

    @property
    def effective_max_staleness(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    @property
    def effective_stale_policy(self) -> Literal["mask", "drop"]:
        return "drop" if self.mode == "sync" else self.stale_policy
