"""Training samples from a session's records (Miles' assembly, on our `miles.common.v1.Sample`). Pure functions.

1. Alignment with the trailing-token trim: for each record, the longest prefix of its sampled ids that equals the
   token buffer at the record's prompt end is kept; the rest (at most the family's `max_trim_tokens`, 0 for the
   last turn) is a stop token the next prompt's rendering replaced. Every record must be explained and the last
   one must end the buffer exactly, else `SampleAssemblyError` (422) naming the first mismatching index.
2. Truncation by `max_seq_len` (prompt + every completion + tool/user tokens), per turn in order: turns that fit
   are kept; the first that does not is cut inside its output to exactly max_seq_len tokens, or dropped when no
   output token would be left; either way the sample ends there, TRUNCATED.
3. `merge` (one sample: loss mask 1 on sampled ids, 0 on prompt/tool/user tokens between turns, logprob 0.0 where
   the mask is 0) or `per_turn` (one sample per turn). A turn's status is TRUNCATED when the engine stopped at
   max_tokens; a merged sample takes its last turn's status. Unlike Miles, a max_tokens cut in the middle of an
   episode does not end the merged sample: the agent saw the cut reply and went on, and the next prompt closes the
   turn with the template's end token, which is not trained on.
A session with nothing to train on gives one ABORTED placeholder (1 token, no response) with an empty_reason.
4. Routing (R3, sessions that record it): every sample, placeholders included, carries the rows of its tokens,
   len(tokens) - 1 of them, cut from the rows assembled for the whole buffer (routing.py): every sample's tokens are
   a prefix of the buffer, and a row depends only on the tokens up to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.common.contracts.weight_version import INITIAL_WEIGHT_VERSION, parse_weight_version
from miles.proto.common.v1 import common_pb2
from miles.session.errors import SampleAssemblyError
from miles.session.records import FinishType, TurnRecord
from miles.session.routing import SessionRouting

SampleMode = Literal["merge", "per_turn"]
COMPLETED, TRUNCATED, ABORTED = "COMPLETED", "TRUNCATED", "ABORTED"


@dataclass(frozen=True)
class TurnSlice:
    """One record placed in the token buffer: sampled ids at [prompt_len, prompt_len + num_kept)."""

    record: TurnRecord
    prompt_len: int
    num_kept: int
    status: str

    @property
    def end(self) -> int:
        return self.prompt_len + self.num_kept


@dataclass(frozen=True)
class WeightSpanData:
    start: int
    end: int
    weight_version: int


@dataclass
class SampleData:
    """A `miles.common.v1.Sample` before encoding (checked against the Sample contract when encoded: samples_wire)."""

    sample_id: str
    tokens: list[int]
    response_start: int
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[WeightSpanData] = field(default_factory=list)
    status: str = COMPLETED
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: common_pb2.RoutedExperts | None = None
    """Rows [0, len(tokens) - 1) of the session's routing, when it records routing."""


def span_version(label: str) -> int:
    """The version a turn's span records for the engine's weight_version label ("default" is 0). A label that is no
    version counts as the initial weights too: the oldest version, so the trainer's staleness bound sees the
    sample at its stalest rather than fresher than it may be."""
    version = parse_weight_version(label)
    return INITIAL_WEIGHT_VERSION if version is None else version


def turn_spans(turn: TurnSlice, offset: int) -> list[WeightSpanData]:
    """The weight spans of a turn's kept tokens, shifted by `offset`: one per version that sampled them (the
    engine's spans when a pause carried the call across an update), none when no token stays (a turn whose only
    token was trimmed, GLM)."""
    raw = turn.record.weight_version_spans or [(0, len(turn.record.completion_ids), turn.record.weight_version)]
    spans: list[WeightSpanData] = []
    for start, end, label in raw:
        end = min(end, turn.num_kept)
        if start < end:
            spans.append(WeightSpanData(offset + start, offset + end, span_version(label)))
    return spans


def align(records: Sequence[TurnRecord], token_ids: Sequence[int], max_trim_tokens: int) -> list[TurnSlice]:
    """Place every record in the buffer with the trailing-token trim (step 1 of the module docstring)."""
    slices: list[TurnSlice] = []
    previous_end = 0
    for index, record in enumerate(records):
        last = index == len(records) - 1
        cursor = record.prompt_len
        if cursor < previous_end or cursor > len(token_ids):
            raise SampleAssemblyError(
                f"record {index}: its prompt length {cursor} is outside [{previous_end}, {len(token_ids)}]",
                details={"record": index, "first_mismatch_index": min(cursor, len(token_ids))},
            )
        output = record.completion_ids
        num_matched = 0
        while (
            num_matched < len(output)
            and cursor + num_matched < len(token_ids)
            and token_ids[cursor + num_matched] == output[num_matched]
        ):
            num_matched += 1
        num_trimmed = len(output) - num_matched
        allowed = 0 if last else max_trim_tokens
        if num_trimmed > allowed:
            raise SampleAssemblyError(
                f"record {index}: {num_trimmed} of its {len(output)} sampled tokens are not in the token buffer "
                f"(allowed trim {allowed}); first mismatch at buffer index {cursor + num_matched}",
                details={"record": index, "first_mismatch_index": cursor + num_matched},
            )
        status = TRUNCATED if record.finish_type is FinishType.LENGTH else COMPLETED
        slices.append(TurnSlice(record, cursor, num_matched, status))
        previous_end = cursor + num_matched
    if slices and slices[-1].end != len(token_ids):
        raise SampleAssemblyError(
            f"the records explain {slices[-1].end} of the buffer's {len(token_ids)} tokens",
            details={"first_mismatch_index": slices[-1].end},
        )
    return slices


def truncate(slices: list[TurnSlice], max_seq_len: int | None) -> list[TurnSlice]:
    """Step 2 of the module docstring."""
    if max_seq_len is None:
        return slices
    kept: list[TurnSlice] = []
    for turn in slices:
        if turn.end <= max_seq_len:
            kept.append(turn)
            continue
        num_left = turn.num_kept - (turn.end - max_seq_len)
        if num_left > 0:
            kept.append(TurnSlice(turn.record, turn.prompt_len, num_left, TRUNCATED))
        elif kept:  # cut at the boundary before this turn
            last = kept[-1]
            kept[-1] = TurnSlice(last.record, last.prompt_len, last.num_kept, TRUNCATED)
        break
    return kept


def _turn_arrays(turn: TurnSlice) -> tuple[list[float], int]:
    """(logprobs of the kept ids with nulls as 0.0, number of nulls)."""
    raw = turn.record.logprobs[: turn.num_kept]
    return [0.0 if lp is None else lp for lp in raw], sum(1 for lp in raw if lp is None)


def _turn_facts(turns: Sequence[TurnSlice]) -> dict[str, Any]:
    return {
        "turn_indices": [t.record.turn_index for t in turns],
        "finish_reasons": [t.record.finish_type.value for t in turns],
        "weight_versions_raw": [t.record.weight_version for t in turns],
        "cached_tokens": sum(t.record.cached_tokens for t in turns),
        "prompt_tokens": sum(t.record.prompt_tokens for t in turns),
    }


def merge(turns: Sequence[TurnSlice], token_ids: Sequence[int], sample_id: str) -> SampleData:
    """One sample over every turn; its status is the last turn's."""
    included = list(turns)
    start = included[0].prompt_len
    sample = SampleData(sample_id, list(token_ids[: included[-1].end]), start, status=included[-1].status)
    num_null = 0
    for turn in included:
        gap = turn.prompt_len - start - len(sample.loss_mask)
        sample.loss_mask.extend([0] * gap)
        sample.rollout_logprobs.extend([0.0] * gap)
        logprobs, nulls = _turn_arrays(turn)
        span_start = len(sample.loss_mask)
        sample.loss_mask.extend([1] * turn.num_kept)
        sample.rollout_logprobs.extend(logprobs)
        num_null += nulls
        sample.weight_versions.extend(turn_spans(turn, span_start))
    sample.metadata = {**_turn_facts(included), "num_null_logprobs": num_null, "num_turns": len(included)}
    return sample


def per_turn(turns: Sequence[TurnSlice], token_ids: Sequence[int], episode_id: str) -> list[SampleData]:
    samples = []
    for turn in turns:
        logprobs, nulls = _turn_arrays(turn)
        samples.append(
            SampleData(
                sample_id=f"{episode_id}/turn-{turn.record.turn_index}",
                tokens=list(token_ids[: turn.end]),
                response_start=turn.prompt_len,
                loss_mask=[1] * turn.num_kept,
                rollout_logprobs=logprobs,
                weight_versions=turn_spans(turn, 0),
                status=turn.status,
                metadata={**_turn_facts([turn]), "num_null_logprobs": nulls, "num_turns": 1},
            )
        )
    return samples


def aborted_placeholder(sample_id: str, placeholder_token_id: int, reason: str) -> SampleData:
    """The one sample of a session with nothing trainable: one token (the proto needs >= 1), no response."""
    return SampleData(sample_id, [placeholder_token_id], 1, status=ABORTED, metadata={"empty_reason": reason})


def build_samples(
    records: Sequence[TurnRecord],
    token_ids: Sequence[int],
    *,
    max_trim_tokens: int,
    mode: SampleMode,
    max_seq_len: int | None,
    episode_id: str,
    placeholder_token_id: int,
    routing: SessionRouting | None = None,
) -> tuple[list[SampleData], str]:
    """(samples, empty_reason): the session's samples, or one ABORTED placeholder and why; with `routing`, each
    carries its rows (step 4 of the module docstring)."""
    turns = truncate(align(records, token_ids, max_trim_tokens), max_seq_len) if records else []
    empty_reason = "" if turns else ("all_truncated" if records else "no_records")
    if empty_reason:
        samples = [aborted_placeholder(episode_id, placeholder_token_id, empty_reason)]
    elif mode == "merge":
        samples = [merge(turns, token_ids, episode_id)]
    else:
        samples = per_turn(turns, token_ids, episode_id)
    if routing is not None:
        for sample in samples:
            sample.routed_experts = routing.for_tokens(sample.tokens, token_ids)
    return samples, empty_reason
