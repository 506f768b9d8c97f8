"""The shape of a `miles.common.v1.Sample` (common.proto's stated invariants), checked by one function everywhere.

`sample_problem` is run where samples cross a service boundary: by the session server on each sample it sends
(a problem there is its own bug), by the buffer on each pushed group (a problem is the producer's: 400), and by
the trainer on each pulled group (it trusts no store: a problem nacks the group). It checks shape only — lengths,
ranges, span layout, status, the byte length of routing against the tokens (contracts.routing) — in O(number of
spans), never per-token values, so the buffer can afford it on every push. What only one side can judge stays
there: the buffer's group-level fields and reward, the trainer's per-token checks against its model (vocabulary,
positions, finite logprobs, expert ids), the session server's logprob-is-0.0-under-a-0-mask guarantee.

The function returns the first problem instead of raising, so that each service maps it to its own error
(InvalidRequestError with a field path, BadGroupError with a reason label, a 500) and names the sample its way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.common.contracts.routing import routing_problem
from miles.proto.common.v1 import common_pb2

TRAINABLE_STATUSES = frozenset({common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED})
"""Statuses that are trained on; ABORTED and FAILED samples travel with their group but are not."""

KNOWN_STATUSES = TRAINABLE_STATUSES | {common_pb2.SAMPLE_STATUS_ABORTED, common_pb2.SAMPLE_STATUS_FAILED}
"""Every status a sample may carry (UNSPECIFIED, i.e. unset, and unknown numbers are not)."""

ProblemKind = Literal["misaligned", "unknown_status", "bad_spans", "bad_routing"]
"""Bounded labels (the trainer uses them as its reject reasons and metric label values)."""


@dataclass(frozen=True)
class SampleProblem:
    """Why a sample breaks the contract. `field` is relative to the sample ("loss_mask", "weight_versions[1]",
    "weight_versions[1].weight_version"); `message` starts with that field, so a caller prefixes both with its own
    path to the sample (e.g. "group.samples[0].")."""

    kind: ProblemKind
    field: str
    message: str


def sample_problem(sample: common_pb2.Sample) -> SampleProblem | None:
    """The first shape invariant `sample` breaks, or None (checks in field order, then the spans)."""
    num_tokens = len(sample.tokens)
    if num_tokens == 0:
        return SampleProblem("misaligned", "tokens", "tokens is empty")
    if not 0 <= sample.response_start <= num_tokens:
        return SampleProblem(
            "misaligned",
            "response_start",
            f"response_start must be within [0, {num_tokens}], got {sample.response_start}",
        )
    num_response = num_tokens - sample.response_start
    if len(sample.loss_mask) != num_response:
        return SampleProblem(
            "misaligned",
            "loss_mask",
            f"loss_mask has {len(sample.loss_mask)} entries, need len(tokens) - response_start = {num_response}",
        )
    if len(sample.rollout_logprobs) != num_response:
        return SampleProblem(
            "misaligned",
            "rollout_logprobs",
            f"rollout_logprobs has {len(sample.rollout_logprobs)} entries, need len(loss_mask) = {num_response}",
        )
    if sample.token_rewards and len(sample.token_rewards) != num_response:
        return SampleProblem(
            "misaligned",
            "token_rewards",
            f"token_rewards has {len(sample.token_rewards)} entries, need 0 or {num_response}",
        )
    if sample.teacher_logprobs and len(sample.teacher_logprobs) != num_response:
        return SampleProblem(
            "misaligned",
            "teacher_logprobs",
            f"teacher_logprobs has {len(sample.teacher_logprobs)} entries, need 0 or {num_response}",
        )
    if sample.status not in KNOWN_STATUSES:
        return SampleProblem("unknown_status", "status", f"status {sample.status} is not a known SampleStatus")
    span_problem = _span_problem(sample, num_response)
    if span_problem is not None:
        return span_problem
    routing = routing_problem(sample)
    return SampleProblem("bad_routing", *routing) if routing is not None else None


def _span_problem(sample: common_pb2.Sample, num_response_tokens: int) -> SampleProblem | None:
    """Spans are ordered, do not overlap, lie within the response and carry a version >= 0."""
    previous_end = 0
    for index, span in enumerate(sample.weight_versions):
        field = f"weight_versions[{index}]"
        if span.start < previous_end:
            return SampleProblem(
                "bad_spans",
                field,
                f"{field}: spans must be ordered and not overlap (start {span.start} < {previous_end})",
            )
        if not span.start < span.end <= num_response_tokens:
            return SampleProblem(
                "bad_spans",
                field,
                f"{field}: need start < end <= {num_response_tokens} response tokens, got [{span.start}, {span.end})",
            )
        if span.weight_version < 0:
            return SampleProblem(
                "bad_spans",
                f"{field}.weight_version",
                f"{field}.weight_version must be >= 0, got {span.weight_version}",
            )
        previous_end = span.end
    return None
