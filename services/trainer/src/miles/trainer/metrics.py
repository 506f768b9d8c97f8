"""Prometheus metrics of the trainer (`miles_trainer_*`), updated once per step, checkpoint or rejection.

Per-step values are gauges named after the step statistic (e.g. `miles_trainer_loss`,
`miles_trainer_train_rollout_logprob_abs_diff_max`); every statistic of a step, including ones not exported
here, is also in the step event and in Status.last_step_metrics. Labels are bounded: phase, reason, the MoE
layer index of `routing_agreement_ratio` (one series per MoE layer of the model; from the step statistics
`routing_agreement_layer_<i>`) and the role of `role_<stat>` (multi-agent episodes, from the step statistics
`<stat>/role=<role>` of roles.py; at most MAX_ROLE_LABELS roles per process, the first ones met).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

from miles.common.telemetry import Metrics
from miles.trainer.batch import REJECT_REASONS
from miles.trainer.roles import MAX_ROLE_LABELS, ROLE_STATS, parse_role_key

log = logging.getLogger(__name__)

STEP_GAUGES: dict[str, str] = {
    "loss": "Total loss of the last step (each optimizer step's over its minibatch, mean over optimizer steps)",
    "pg_loss": "Policy-gradient term of the last step's loss",
    "sft_loss": "SFT negative log-likelihood of the last step",
    "kl": "KL to the reference (aggregated like the loss) of the last step",
    "entropy": "Mean entropy of the policy over loss tokens, last step",
    "pg_clipfrac": "Fraction of loss tokens where the PPO clip was active, mean over the last step's optimizer steps",
    "pg_dual_clipfrac": "Fraction of loss tokens where the dual clip was active, last step",
    "reward_mean": "Mean reward of the trained batch's trainable samples, last step (informative groups only when "
    "dynamic sampling discards the others)",
    "rollout_reward_mean": "Mean reward of the trainable samples of every valid group pulled for the last step, "
    "the ones dynamic sampling discarded included: how well the policy does",
    "reward_std": "Standard deviation of rewards of trainable samples, last step",
    "advantage_mean": "Mean advantage of trainable samples, last step",
    "advantage_std": "Standard deviation of advantages of trainable samples, last step",
    "is_ratio": "Mean exp(train_logp - rollout_logp) over loss tokens, last step",
    "is_ratio_min": "Smallest train/rollout probability ratio, last step",
    "is_ratio_max": "Largest train/rollout probability ratio, last step",
    "is_weight": "Mean TIS/MIS weight over kept loss tokens, last step",
    "is_clamped_fraction": "Fraction of loss tokens whose IS weight was clamped or truncated, last step",
    "is_masked_fraction": "Fraction of loss tokens dropped by MIS masking or rejection, last step",
    "is_veto_seq_fraction": "Fraction of sequences vetoed by MIS rejection, last step",
    "train_rollout_logprob_abs_diff": "Mean |train_logp - rollout_logp| over loss tokens, last step",
    "train_rollout_logprob_abs_diff_max": "Max |train_logp - rollout_logp| over loss tokens, last step",
    "grad_norm": "Global gradient norm before clipping, mean over the last step's optimizer steps",
    "learning_rate": "Learning rate of the last step",
    "staleness_mean": "Mean staleness (versions) of the groups of the last step",
    "staleness_max": "Largest staleness (versions) of the groups of the last step",
    "stale_masked_token_fraction": "Share of the last step's loss tokens masked as sampled more than max_staleness "
    "versions before it (stale_policy mask: the early turns of episodes that ran on across updates)",
    "tokens_per_second": "Tokens (prompt + response) of the batch per second of the step's forward/backward passes",
    "ppo_ratio_min": "Smallest PPO ratio pi_theta / pi_old (or / mu with old_logprobs rollout) over loss tokens",
    "ppo_ratio_max": "Largest PPO ratio pi_theta / pi_old (or / mu with old_logprobs rollout) over loss tokens",
    "num_optimizer_steps": "Optimizer steps of the last trainer step (ppo_epochs x minibatches with signal)",
    "num_optimizer_steps_skipped": "Optimizer steps the last trainer step skipped (minibatches without signal)",
    "zero_signal_fraction": "Fraction of the valid groups pulled for the last step whose rewards were all equal",
    "routing_replay": "MoE models: 1 when the trainer replays the rollout's routing (R3), 0 when it routes itself",
    "distill_reverse_kl_mean": "On-policy distillation: mean (student - teacher) logprob over the batch's loss "
    "tokens, the per-token reverse-KL estimate at the student's own tokens, last step",
    "distill_reverse_kl_std": "On-policy distillation: standard deviation of (student - teacher) logprob over the "
    "batch's loss tokens, last step",
    "distill_advantage_mean": "On-policy distillation: mean per-token advantage over loss tokens, last step",
    "value_loss": "PPO with a critic: value loss (clipped, before value_loss_coef, aggregated like the loss)",
    "value_clipfrac": "PPO with a critic: fraction of loss tokens where the value clip was active, last step",
    "value_mean": "PPO with a critic: mean value-head prediction over loss tokens before the step's update",
    "value_explained_variance": "PPO with a critic: 1 - Var(return - value) / Var(return) over the batch's loss "
    "tokens, values before the step's update (1: perfect critic, 0 or below: no better than a constant)",
}
_LAYER_AGREEMENT = re.compile(r"routing_agreement_layer_(\d+)")


class TrainerMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.step = metrics.gauge("step", "Optimizer steps taken (restored from a checkpoint included)")
        self.weight_version = metrics.gauge("weight_version", "Weight version of the current policy")
        self.checkpoint_step = metrics.gauge("checkpoint_step", "Step of the last durable checkpoint (-1: none)")
        self.steps = metrics.counter("steps", "Trainer steps (published versions) taken by this process")
        self.steps_skipped = metrics.counter(
            "steps_skipped", "Trainer steps skipped: no optimizer step had signal (groups consumed, nothing published)"
        )
        self.groups_trained = metrics.counter("groups_trained", "Groups trained on by this process")
        self.samples_trained = metrics.counter("samples_trained", "Trainable samples trained on by this process")
        self.tokens_trained = metrics.counter("tokens_trained", "Tokens (prompt + response) forwarded in training")
        self.stale_masked_tokens = metrics.counter(
            "stale_masked_tokens", "Loss tokens masked as older than max_staleness (stale_policy mask), not trained"
        )
        self.groups_rejected = metrics.counter(
            "groups_rejected", "Groups nacked (discarded) as untrainable, by reason", ["reason"]
        )
        self.groups_zero_signal = metrics.counter(
            "groups_zero_signal", "Groups discarded by dynamic sampling: every trainable reward equal (no advantage)"
        )
        self.groups_already_trained = metrics.counter(
            "groups_already_trained", "Redelivered groups whose update a checkpoint already holds (acked, not trained)"
        )
        self.groups_acked = metrics.counter("groups_acked", "Leases acked after a durable checkpoint")
        self.leases_lost = metrics.counter("leases_lost", "Leases that expired before their ack (group redelivered)")
        self.checkpoints = metrics.counter("checkpoints", "Durable checkpoints written")
        self.publish_failures = metrics.counter(
            "publish_failures",
            "Publish attempts that failed and were retried, plus engines that failed to load a version (nccl, disk)",
        )
        self.published_version = metrics.gauge("published_version", "Newest weight version published (-1: none)")
        self.phase_seconds = metrics.histogram(
            "step_phase_duration_seconds",
            "Time per step phase: wait_data, forward_backward, optimizer, publish, checkpoint",
            ["phase"],
        )
        self.group_staleness = metrics.histogram(
            "group_staleness_versions", "Staleness of consumed groups", buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32)
        )
        self.step_gauges = {name: metrics.gauge(name, doc) for name, doc in STEP_GAUGES.items()}
        self.routing_agreement = metrics.gauge(
            "routing_agreement_ratio",
            "MoE: fraction of the last step's routed token positions whose trainer top-k experts equal the rollout's, "
            "per MoE layer (0-based among the MoE layers)",
            ["layer"],
        )
        self.role_gauges = {stat: metrics.gauge(f"role_{stat}", doc, ["role"]) for stat, doc in ROLE_STATS.items()}
        self.roles: list[str] = []
        """Roles with series, in the order met (at most MAX_ROLE_LABELS)."""
        self._unexported_roles: set[str] = set()
        for reason in REJECT_REASONS:
            self.groups_rejected.labels(reason)
        self.checkpoint_step.set(-1)
        self.published_version.set(-1)

    def observe_step(
        self, values: Mapping[str, float], staleness: Sequence[int], *, num_samples: int, num_tokens: int
    ) -> None:
        """A trainer step that moved the weights: counters, phase durations, staleness and the step gauges."""
        self.steps.inc()
        self.groups_trained.inc(len(staleness))
        self.samples_trained.inc(num_samples)
        self.tokens_trained.inc(num_tokens)
        self.stale_masked_tokens.inc(values.get("stale_masked_tokens", 0.0))
        for phase in ("wait_data", "forward_backward", "optimizer"):
            self.phase_seconds.labels(phase).observe(values[f"{phase}_s"])
        for versions in staleness:
            self.group_staleness.observe(versions)
        self._set_gauges(values)

    def observe_skipped_step(self, values: Mapping[str, float]) -> None:
        """A trainer step without signal: counted; only the gauges it has values for move."""
        self.steps_skipped.inc()
        self._set_gauges(values)

    def _set_gauges(self, values: Mapping[str, float]) -> None:
        for name, gauge in self.step_gauges.items():
            if name in values:
                gauge.set(values[name])
        for name, value in values.items():
            match = _LAYER_AGREEMENT.fullmatch(name)
            if match is not None:
                self.routing_agreement.labels(match.group(1)).set(value)
        self._set_role_gauges(values)

    def _set_role_gauges(self, values: Mapping[str, float]) -> None:
        """Per-role gauges of the step; a known role absent from it has 0 samples (its rewards keep their value)."""
        present: dict[str, dict[str, float]] = {}
        for name, value in values.items():
            parsed = parse_role_key(name)
            if parsed is not None:
                present.setdefault(parsed[1], {})[parsed[0]] = value
        for role in present:
            if role in self.roles or role in self._unexported_roles:
                continue
            if len(self.roles) < MAX_ROLE_LABELS:
                self.roles.append(role)
            else:  # said once per role
                self._unexported_roles.add(role)
                log.warning("role not exported: more than %d roles", MAX_ROLE_LABELS, extra={"role": role})
        for role in self.roles:
            stats = present.get(role, {"num_samples": 0.0, "num_trainable_samples": 0.0})
            for stat, value in stats.items():
                self.role_gauges[stat].labels(role).set(value)
