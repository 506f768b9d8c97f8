"""Training health of a job at a glance: the reward trend and the statistics that announce a collapse.

`job_health` reads the trainer's last-step statistics (as the controller stores them) and the mean reward of every
step the controller saw (`JobRecord.rewards`), and says what looks wrong. The thresholds are the ones the chart's
alert rules use by default (monitoring.prometheusRules), so `miles status` and Grafana agree:

| warning                   | when                                                                      |
|---------------------------|---------------------------------------------------------------------------|
| reward falling            | mean of the last 3 steps < best 3-step mean so far - 0.15                 |
| entropy collapsed         | entropy of the policy on its sampled tokens < 0.05                        |
| train/rollout logprob gap | mean abs(train - rollout) logprob > 0.3: engines serve other weights      |
| no signal                 | more than 80% of the groups pulled for the last step had equal rewards    |

Limits: the reward history is what the controller observed (a step it missed between two observations is
absent); statistics are the last step's, not averages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

WINDOW_STEPS = 3
REWARD_DROP = 0.15
MIN_ENTROPY = 0.05
MAX_LOGPROB_DIFF = 0.3
MAX_ZERO_SIGNAL_FRACTION = 0.8
MAX_REWARDS_KEPT = 1000


def policy_reward(metrics: Mapping[str, float]) -> float | None:
    """The reward of the policy at the last step: over every valid group the trainer pulled (the trainer's
    `rollout_reward_mean`), else the trained batch's `reward_mean` (older trainers; it leaves out the groups
    dynamic sampling discarded, so it reads low once the policy solves most prompts)."""
    value = metrics.get("rollout_reward_mean", metrics.get("reward_mean"))
    return None if value is None else float(value)


@dataclass(frozen=True)
class JobHealth:
    reward_first: float | None
    """Mean reward of the first WINDOW_STEPS observed steps."""
    reward_last: float | None
    """Mean reward of the last WINDOW_STEPS observed steps."""
    entropy: float | None
    grad_norm: float | None
    logprob_diff: float | None
    zero_signal_fraction: float | None
    clip_fraction: float | None
    warnings: list[str] = field(default_factory=list)


def _window(rewards: Sequence[float], *, last: bool) -> float | None:
    chosen = rewards[-WINDOW_STEPS:] if last else rewards[:WINDOW_STEPS]
    return sum(chosen) / len(chosen) if chosen else None


def _best_window(rewards: Sequence[float]) -> float | None:
    if len(rewards) < WINDOW_STEPS:
        return None
    return max(sum(rewards[i : i + WINDOW_STEPS]) / WINDOW_STEPS for i in range(len(rewards) - WINDOW_STEPS + 1))


def job_health(metrics: Mapping[str, float], rewards: Sequence[float]) -> JobHealth:
    """The job's health from its last-step statistics and its reward per observed step."""
    reward_last = _window(rewards, last=True)
    best = _best_window(rewards)
    warnings = []
    if best is not None and reward_last is not None and reward_last < best - REWARD_DROP:
        warnings.append(f"reward falling: {reward_last:.2f} over the last {WINDOW_STEPS} steps, best {best:.2f}")
    entropy = metrics.get("entropy")
    if entropy is not None and entropy < MIN_ENTROPY:
        warnings.append(f"entropy collapsed: {entropy:.3f}")
    diff = metrics.get("train_rollout_logprob_abs_diff")
    if diff is not None and diff > MAX_LOGPROB_DIFF:
        warnings.append(f"train/rollout logprob gap {diff:.2f}: engines may serve other weights than trained")
    zero_signal = metrics.get("zero_signal_fraction")
    if zero_signal is not None and zero_signal > MAX_ZERO_SIGNAL_FRACTION:
        warnings.append(f"no signal: {zero_signal:.0%} of the pulled groups had equal rewards")
    return JobHealth(
        reward_first=_window(rewards, last=False),
        reward_last=reward_last,
        entropy=entropy,
        grad_norm=metrics.get("grad_norm"),
        logprob_diff=diff,
        zero_signal_fraction=zero_signal,
        clip_fraction=metrics.get("pg_clipfrac"),
        warnings=warnings,
    )
