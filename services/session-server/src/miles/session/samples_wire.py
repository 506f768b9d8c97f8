"""The samples payload on the wire: `miles.session.v1.SessionSamples` of `miles.common.v1.Sample`s.

Protobuf binary for `Accept: application/x-protobuf`, else the protobuf JSON mapping with the proto's field names
(`google.protobuf.json_format.Parse` reads either spelling back). Every sample is checked as it is encoded: the
Sample contract the buffer and the trainer check too (miles.common.contracts.samples: routing included, exactly
len(tokens) - 1 rows when present), plus this server's own
guarantee that a logprob under a 0 loss mask is 0.0. A failure is this server's bug (SampleContractError, 500).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from miles.common.contracts.samples import sample_problem
from miles.proto.common.v1 import common_pb2
from miles.proto.session.v1 import session_pb2
from miles.session.errors import SampleContractError
from miles.session.records import Json, SessionMeta
from miles.session.samples import SampleData


def to_sample(sample: SampleData, meta: SessionMeta, *, group_id: str, reward: float, metadata: Json) -> Any:
    """One `miles.common.v1.Sample`; `metadata` is merged under the sample's own facts."""
    message = common_pb2.Sample(
        sample_id=sample.sample_id,
        group_id=group_id,
        episode_id=meta.episode_id,
        tokens=sample.tokens,
        response_start=sample.response_start,
        loss_mask=sample.loss_mask,
        rollout_logprobs=sample.rollout_logprobs,
        weight_versions=[
            common_pb2.WeightSpan(start=s.start, end=s.end, weight_version=s.weight_version)
            for s in sample.weight_versions
        ],
        reward=reward,
        status=f"SAMPLE_STATUS_{sample.status}",
    )
    if sample.routed_experts is not None:
        message.rollout_routed_experts.CopyFrom(sample.routed_experts)
    message.metadata.update({**metadata, **sample.metadata, "session_id": meta.session_id, "job_id": meta.job_id})
    _check_built(message)
    return message


def _check_built(message: common_pb2.Sample) -> None:
    """SampleContractError when a built sample breaks the contract or this server's guarantee (module docstring);
    the zip is strict because sample_problem has checked the lengths first."""
    problem = sample_problem(message)
    if problem is not None:
        raise SampleContractError(f"sample {message.sample_id!r}: {problem.message}", field=problem.field)
    pairs = zip(message.rollout_logprobs, message.loss_mask, strict=True)
    if any(logprob != 0.0 for logprob, mask in pairs if not mask):
        raise SampleContractError(
            f"sample {message.sample_id!r}: rollout_logprobs must be 0.0 where loss_mask is 0", field="rollout_logprobs"
        )


def session_samples(meta: SessionMeta, samples: list[Any], *, empty_reason: str, session_metadata: Json) -> Any:
    message = session_pb2.SessionSamples(
        session_id=meta.session_id, job_id=meta.job_id, episode_id=meta.episode_id, empty_reason=empty_reason
    )
    message.samples.extend(samples)
    message.session_metadata.update(session_metadata)
    return message


def to_dict(message: Any) -> Json:
    """The JSON form of a message (proto field names), as a dict to write in pieces (json_stream.py)."""
    return dict(json_format.MessageToDict(message, preserving_proto_field_name=True))
