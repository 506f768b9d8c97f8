"""Prompt groups: their deterministic ids, the group filters, and the `miles.common.v1.Group` that is pushed.

A group id is a function of (job, epoch, prompt index) only, so a group regenerated after a crash or by a
second worker gets the same id and the buffer keeps the first one pushed (DUPLICATE for the others).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from miles.common.jobspec.rollout import GroupFilterSpec
from miles.proto.common.v1 import common_pb2
from miles.rollout import samples as sample_ops
from miles.rollout.episode import EpisodeOutcome


def group_id_for(job_id: str, epoch: int, prompt_index: int) -> str:
    return f"{job_id}/e{epoch}/p{prompt_index}"


def filter_reason(samples: Sequence[common_pb2.Sample], filters: GroupFilterSpec) -> str | None:
    """Why the group must not be pushed (`all_aborted`, `too_few_valid`, `equal_rewards`: within each role), or
    None."""
    trainable = [sample for sample in samples if sample_ops.is_trainable(sample)]
    if not trainable:
        return "all_aborted"
    if len(trainable) < max(1, filters.min_valid_samples):
        return "too_few_valid"
    if filters.drop_equal_rewards and _equal_within_each_role(trainable):
        return "equal_rewards"
    return None


def _equal_within_each_role(trainable: Sequence[common_pb2.Sample]) -> bool:
    """Whether every role's trainable rewards are one value (no roles: all of them). The trainer normalises
    advantages per (group, role), so a solver always right and a verifier always wrong carry no signal either."""
    rewards_by_role: dict[str, set[float]] = {}
    for sample in trainable:
        rewards_by_role.setdefault(sample_ops.role_of(sample), set()).add(sample.reward)
    return all(len(rewards) == 1 for rewards in rewards_by_role.values())


def build_group(
    *,
    job_id: str,
    group_id: str,
    epoch: int,
    prompt_index: int,
    outcomes: Sequence[EpisodeOutcome],
    prompt: dict[str, Any],
) -> common_pb2.Group:
    """The group of every episode's samples (in sample-index order), with the prompt and outcome counts."""
    group = common_pb2.Group(
        group_id=group_id,
        job_id=job_id,
        prompt_index=prompt_index,
        epoch=epoch,
        created_at_unix_ms=int(time.time() * 1000),
    )
    reasons: dict[str, int] = {}
    for outcome in outcomes:
        group.samples.extend(outcome.samples)
        reasons[outcome.reason] = reasons.get(outcome.reason, 0) + 1
    group.metadata.update(
        sample_ops.json_safe(
            {"messages": prompt.get("messages", []), "num_episodes": len(outcomes), "episode_reasons": reasons}
        )
    )
    return group
