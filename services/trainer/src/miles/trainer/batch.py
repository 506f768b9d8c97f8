"""From buffer groups to training samples: validation (what the trainer cannot train on is rejected with a
reason) and the per-sample data every backend consumes.

The buffer checks shapes at push time, but the trainer does not trust that: a group from an older producer, a
corrupted store or a buggy agent must never crash a step. Every sample is held to the shared Sample contract
(miles.common.contracts.samples, the check the buffer runs; its problem kinds are reasons here); the samples
trained on also to per-token checks against the model. Each check maps to one bounded `reason` label (used in the
nack reason and the `miles_trainer_groups_rejected_total{reason}` counter).

Roles (multi-agent episodes): a sample's `metadata["role"]` names its role (a non-empty string, else the group is
refused as `bad_role`); advantages keep roles apart (advantages.py). Samples without it have no role.

MoE routing (R3): the routing a trainable sample carries is held to the model (layers, top_k, expert ids: the
model's forward refuses anything else) and unpacked, whether or not the job replays it (without replay it feeds
the routing-agreement statistic). With replay on, a trainable sample without routing is refused
(`missing_routing`): it is never trained with the trainer's own routing. Samples that are not trained on
(ABORTED, FAILED) are neither checked nor unpacked.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles.common.contracts.routing import RoutingShape, unpack
from miles.common.contracts.samples import TRAINABLE_STATUSES, sample_problem
from miles.proto.common.v1 import common_pb2

REJECT_REASONS = (
    "empty_group",
    "misaligned",  # with unknown_status, bad_spans and bad_routing: the shared contract's ProblemKind values
    "unknown_status",
    "bad_loss_mask",
    "bad_spans",
    "bad_routing",
    "missing_routing",
    "token_out_of_range",
    "too_long",
    "non_finite",
    "empty_prompt",
    "superseded_version",
    "bad_role",
    "missing_teacher_logprobs",
)
ROLE_KEY = "role"
"""The Sample.metadata key naming a sample's role in a multi-agent episode."""


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
    [num_tokens - 1, num_moe_layers, top_k] (miles.common.contracts.routing), checked against the model; None
    when the sample carries none (dense model, or a job without replay whose producer did not record it) and for
    samples that are not trained on. Replayed only when the job replays (`TrainConfig.routing_replay`)."""
    role: str | None = None
    """The sample's role in a multi-agent episode (`metadata["role"]`); None: no role."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each response token (`Sample.teacher_logprobs`); None when
    the sample carries none."""
    token_advantages: list[float] | None = None
    """A per-response-token advantage (on-policy distillation) that replaces `advantage` in the loss; None: every
    token gets `advantage`."""
    num_stale_masked_tokens: int = 0
    """Loss tokens of spans older than the staleness bound, masked out of `loss_mask` (stale_policy mask)."""

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
    if any(not math.isfinite(lp) for lp in sample.teacher_logprobs):
        raise BadGroupError("non_finite", f"{where} has a non-finite teacher logprob")
    if sample.response_start == 0 and any(sample.loss_mask[:1]):
        raise BadGroupError("empty_prompt", f"{where}: the first token has no context to be scored in")


def _role(sample: common_pb2.Sample, where: str) -> str | None:
    """`metadata["role"]`: None when absent; anything but a non-empty string is refused."""
    value = sample.metadata.fields.get(ROLE_KEY)
    if value is None:
        return None
    if value.WhichOneof("kind") != "string_value" or not value.string_value:
        raise BadGroupError("bad_role", f"{where}.metadata[{ROLE_KEY!r}] is not a non-empty string")
    return value.string_value


def _routed_experts(
    sample: common_pb2.Sample, where: str, routing: RoutingShape | None, replay: bool
) -> array[int] | None:
    """The unpacked routing of a trainable sample (its byte length is already checked against its tokens)."""
    if not sample.HasField("rollout_routed_experts"):
        if replay:
            raise BadGroupError(
                "missing_routing", f"{where} has no rollout_routed_experts, and the job replays routing (R3)"
            )
        return None
    routed = sample.rollout_routed_experts
    name = f"{where}.rollout_routed_experts"
    if routing is None:
        raise BadGroupError("bad_routing", f"{name} is set but the model has no MoE layers")
    if (routed.num_layers, routed.top_k) != (routing.num_layers, routing.top_k):
        raise BadGroupError(
            "bad_routing",
            f"{name} has {routed.num_layers} layers x top {routed.top_k}, the model routes "
            f"{routing.num_layers} MoE layers x top {routing.top_k}",
        )
    ids = unpack(routed)
    problem = _expert_id_problem(ids, routing)
    if problem is not None:
        raise BadGroupError("bad_routing", f"{name} {problem}")
    return ids


def _expert_id_problem(ids: array[int], routing: RoutingShape) -> str | None:
    """What the model's replay would refuse: ids outside [0, num_experts), an expert twice in one top-k.
    Vectorised (a sample holds len(tokens) x layers x top_k ids)."""
    if not ids:
        return None
    import torch

    rows = torch.frombuffer(ids, dtype=torch.int32).view(-1, routing.top_k)
    low, high = int(rows.min()), int(rows.max())
    if low < 0 or high >= routing.num_experts:
        return f"holds expert ids in [{low}, {high}], the model has {routing.num_experts} experts"
    ordered = rows.sort(dim=1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        return "repeats an expert within a position's top-k"
    return None


def samples_from_group(
    group: common_pb2.Group,
    group_index: int,
    *,
    vocab_size: int,
    max_positions: int,
    routing: RoutingShape | None = None,
    routing_replay: bool = False,
    distillation: bool = False,
    stale_before: int | None = None,
) -> list[TrainSample]:
    """Validated samples of one group; raises BadGroupError. `routing`: the model's MoE routing shape (None: a
    dense model); `routing_replay`: whether the job replays routing (trainable samples must then carry it);
    `distillation`: whether the job distills (trainable samples must then carry their teacher's logprobs);
    `stale_before`: spans sampled by an older version are masked out of the loss (partial rollout: they stay
    context), and min/max_version are those of the remaining spans (None when none remains)."""
    if not group.samples:
        raise BadGroupError("empty_group", f"group {group.group_id!r} has no samples")
    samples = []
    for index, sample in enumerate(group.samples):
        where = f"samples[{index}]"
        _check_sample(sample, where, vocab_size, max_positions)
        trainable = sample.status in TRAINABLE_STATUSES
        role = _role(sample, where)
        routed = _routed_experts(sample, where, routing, routing_replay) if trainable else None
        if distillation and trainable and not sample.teacher_logprobs:
            raise BadGroupError("missing_teacher_logprobs", f"{where} of a distillation job has no teacher logprobs")
        versions = [span.weight_version for span in sample.weight_versions]
        loss_mask, num_masked = _mask_stale_spans(sample, stale_before)
        fresh = versions if stale_before is None else [v for v in versions if v >= stale_before]
        samples.append(
            TrainSample(
                group_id=group.group_id,
                sample_id=sample.sample_id or f"{group.group_id}/{index}",
                group_index=group_index,
                tokens=list(sample.tokens),
                response_start=sample.response_start,
                loss_mask=loss_mask,
                rollout_logprobs=list(sample.rollout_logprobs),
                reward=float(sample.reward),
                trainable=trainable,
                min_version=min(fresh) if fresh else None,
                max_version=max(fresh) if fresh else None,
                span_versions=tuple(versions),
                routed_experts=routed,
                role=role,
                teacher_logprobs=list(sample.teacher_logprobs) if sample.teacher_logprobs else None,
                num_stale_masked_tokens=num_masked if trainable else 0,
            )
        )
    return samples


def _mask_stale_spans(sample: common_pb2.Sample, stale_before: int | None) -> tuple[list[int], int]:
    """The sample's loss mask with every span older than `stale_before` zeroed, and how many loss tokens that
    removed."""
    loss_mask = list(sample.loss_mask)
    num_masked = 0
    if stale_before is None:
        return loss_mask, 0
    for span in sample.weight_versions:
        if span.weight_version < stale_before:
            num_masked += sum(loss_mask[span.start : span.end])
            loss_mask[span.start : span.end] = [0] * (span.end - span.start)
    return loss_mask, num_masked


def group_staleness(samples: Sequence[TrainSample], trainer_version: int) -> int:
    """trainer_version - oldest span version of the group, floored at 0 (0 when no sample has spans)."""
    versions = [s.min_version for s in samples if s.min_version is not None]
    return max(0, trainer_version - min(versions)) if versions else 0
