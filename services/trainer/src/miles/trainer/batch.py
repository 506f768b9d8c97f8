"""From buffer groups to training samples: validation (what the trainer cannot train on is rejected with a
reason) and the per-sample data every backend consumes.

The buffer checks shapes at push time, but the trainer does not trust that: a group from an older producer, a
corrupted store or a buggy agent must never crash a step. Every sample is held to the shared Sample contract
(miles.common.contracts.samples, the check the buffer runs; its problem kinds are reasons here); the samples
trained on also to per-token checks against the model. Each check maps to one bounded `reason` label (used in the
nack reason and the `miles_trainer_groups_rejected_total{reason}` counter).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles.common.contracts.samples import TRAINABLE_STATUSES, sample_problem
from miles.proto.common.v1 import common_pb2

REJECT_REASONS = (
    "empty_group",
    "misaligned",  # with unknown_status, bad_spans and bad_routing: the shared contract's ProblemKind values
    "unknown_status",
    "bad_loss_mask",
    "bad_spans",
    "bad_routing",
    "token_out_of_range",
    "too_long",
    "non_finite",
    "empty_prompt",
    "superseded_version",
)


class BadGroupError(Exception):
    """A group the trainer cannot train on. `reason` is one of REJECT_REASONS; `message` says where and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        assert reason in REJECT_REASONS, reason
        self.reason = reason
        self.message = message


@dataclass
class TrainSample:
    """One sample as the trainer uses it. Invariant: len(loss_mask) == len(rollout_logprobs) ==
    len(tokens) - response_start, and response_start >= 1 when any loss_mask entry is 1."""

    group_id: str
    sample_id: str
    group_index: int
    tokens: list[int]
    response_start: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    trainable: bool
    min_version: int | None
    max_version: int | None
    advantage: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    span_versions: tuple[int, ...] = ()
    """The weight version of each generated span (what generated the response)."""
    routed_experts: array[int] | None = None
    """Routing replay (R3): the experts the engine routed each position to, flat int32 ids, row-major
    [num_tokens - 1, num_moe_layers, top_k] (miles.common.contracts.routing); None when the job does not replay."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask) if self.trainable else 0


def _check_sample(sample: common_pb2.Sample, where: str, vocab_size: int, max_positions: int) -> None:
    """The shared Sample contract for every sample, then, for the ones trained on, what the model needs."""
    problem = sample_problem(sample)
    if problem is not None:
        raise BadGroupError(problem.kind, f"{where}.{problem.message}")
    if sample.status not in TRAINABLE_STATUSES:
        return
    num_tokens = len(sample.tokens)
    if any(value not in (0, 1) for value in sample.loss_mask):
        raise BadGroupError("bad_loss_mask", f"{where}.loss_mask has values other than 0 and 1")
    if any(not 0 <= token < vocab_size for token in sample.tokens):
        raise BadGroupError("token_out_of_range", f"{where}.tokens has ids outside [0, {vocab_size})")
    if num_tokens > max_positions:
        raise BadGroupError("too_long", f"{where} has {num_tokens} tokens, the model allows {max_positions}")
    if not math.isfinite(sample.reward) or any(not math.isfinite(lp) for lp in sample.rollout_logprobs):
        raise BadGroupError("non_finite", f"{where} has a non-finite reward or rollout logprob")
    if sample.response_start == 0 and any(sample.loss_mask[:1]):
        raise BadGroupError("empty_prompt", f"{where}: the first token has no context to be scored in")


def samples_from_group(
    group: common_pb2.Group, group_index: int, *, vocab_size: int, max_positions: int
) -> list[TrainSample]:
    """Validated samples of one group; raises BadGroupError."""
    if not group.samples:
        raise BadGroupError("empty_group", f"group {group.group_id!r} has no samples")
    samples = []
    for index, sample in enumerate(group.samples):
        _check_sample(sample, f"samples[{index}]", vocab_size, max_positions)
        versions = [span.weight_version for span in sample.weight_versions]
        samples.append(
            TrainSample(
                group_id=group.group_id,
                sample_id=sample.sample_id or f"{group.group_id}/{index}",
                group_index=group_index,
                tokens=list(sample.tokens),
                response_start=sample.response_start,
                loss_mask=list(sample.loss_mask),
                rollout_logprobs=list(sample.rollout_logprobs),
                reward=float(sample.reward),
                trainable=sample.status in TRAINABLE_STATUSES,
                min_version=min(versions) if versions else None,
                max_version=max(versions) if versions else None,
                span_versions=tuple(versions),
            )
        )
    return samples


def group_staleness(samples: Sequence[TrainSample], trainer_version: int) -> int:
    """trainer_version - oldest span version of the group, floored at 0 (0 when no sample has spans)."""
    versions = [s.min_version for s in samples if s.min_version is not None]
    return max(0, trainer_version - min(versions)) if versions else 0
