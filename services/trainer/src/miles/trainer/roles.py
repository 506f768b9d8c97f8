"""Per-role step statistics of multi-agent episodes: their names in the step metrics and how they are computed.

A sample of a multi-agent episode carries its role (`TrainSample.role`, from `Sample.metadata["role"]`). For every
role present in a step's batch the step metrics gain `<stat>/role=<role>` for each stat of ROLE_STATS, e.g.
`reward_mean/role=solver`: the batch-wide statistic of the same name restricted to that role's samples. They
travel like every step statistic (step event, Status.last_step_metrics, the controller's progress events) and
are exported as `miles_trainer_role_<stat>{role}` gauges (metrics.py). Samples without a role are in the batch-wide
statistics only.

Limit: the gauges' `role` label is bounded by MAX_ROLE_LABELS (the job spec's own bound on `rollout.roles`); the
roles a process meets beyond it are in the step metrics but not exported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles.trainer.batch import TrainSample

ROLE_STATS: dict[str, str] = {
    "reward_mean": "Mean reward of the role's trainable samples in the last step's batch",
    "reward_std": "Standard deviation of the rewards of the role's trainable samples, last step",
    "num_samples": "Samples of the role in the last step's batch",
    "num_trainable_samples": "Trainable (COMPLETED / TRUNCATED) samples of the role in the last step's batch",
}
MAX_ROLE_LABELS = 8
_SEPARATOR = "/role="


def role_key(stat: str, role: str) -> str:
    """The step-metrics name of `stat` for `role` (`reward_mean/role=solver`)."""
    return f"{stat}{_SEPARATOR}{role}"


def parse_role_key(name: str) -> tuple[str, str] | None:
    """(stat, role) of a per-role step-metrics name, None for any other name."""
    stat, separator, role = name.partition(_SEPARATOR)
    if not separator or stat not in ROLE_STATS or not role:
        return None
    return stat, role


def role_stats(samples: Sequence[TrainSample]) -> dict[str, float]:
    """ROLE_STATS of every role among `samples` (nothing for samples without a role)."""
    by_role: dict[str, list[TrainSample]] = {}
    for sample in samples:
        if sample.role is not None:
            by_role.setdefault(sample.role, []).append(sample)
    stats: dict[str, float] = {}
    for role, members in by_role.items():
        rewards = [s.reward for s in members if s.trainable]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else 0.0
        stats[role_key("reward_mean", role)] = mean
        stats[role_key("reward_std", role)] = std
        stats[role_key("num_samples", role)] = float(len(members))
        stats[role_key("num_trainable_samples", role)] = float(len(rewards))
    return stats
