"""Small operations on `miles.common.v1.Sample`s as the session server built them.

The worker never changes tokens, loss masks or logprobs (TITO: what the engine consumed and sampled is what is
trained on). It sets status, reward, per-token rewards and metadata, and — only under the `keep` partial-rollout
policy — folds the weight spans into one span at the oldest version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from miles.common.contracts.samples import TRAINABLE_STATUSES
from miles.proto.common.v1 import common_pb2

COMPLETED = common_pb2.SAMPLE_STATUS_COMPLETED
TRUNCATED = common_pb2.SAMPLE_STATUS_TRUNCATED
ABORTED = common_pb2.SAMPLE_STATUS_ABORTED
FAILED = common_pb2.SAMPLE_STATUS_FAILED
MAX_ERROR_CHARS = 2000


def status_name(status: int) -> str:
    return str(common_pb2.SampleStatus.Name(status)).removeprefix("SAMPLE_STATUS_")


def is_trainable(sample: common_pb2.Sample) -> bool:
    return sample.status in TRAINABLE_STATUSES


def placeholder(episode_id: str, group_id: str) -> common_pb2.Sample:
    """The sample of an episode the session server could not give one for: one token, no response."""
    return common_pb2.Sample(
        sample_id=episode_id, group_id=group_id, episode_id=episode_id, tokens=[0], response_start=1, status=ABORTED
    )


def role_of(sample: common_pb2.Sample) -> str:
    """The sample's role in a multi-agent episode (`metadata.role`), "" without roles."""
    return str(sample.metadata["role"]) if "role" in sample.metadata else ""


def label_role(samples: Iterable[common_pb2.Sample], role: str, episode_id: str) -> None:
    """Stamps one role session's samples with their role: `metadata.role` (the session server sets it too; the
    worker's placeholders and agent-returned metadata must not lose it) and a sample id unique in the group,
    `<episode_id>/<role>` + the session server's suffix, since every role's session has the same episode id."""
    for sample in samples:
        if sample.sample_id.startswith(episode_id):
            sample.sample_id = f"{episode_id}/{role}{sample.sample_id.removeprefix(episode_id)}"
        else:
            sample.sample_id = f"{sample.sample_id}/{role}"
        sample.metadata.update({"role": role})


def json_safe(value: Any) -> Any:
    """A JSON-compatible copy (what a protobuf Struct can hold); unknown objects become their str()."""
    return json.loads(json.dumps(value, default=str))


def update_metadata(samples: Iterable[common_pb2.Sample], values: dict[str, Any]) -> None:
    safe = json_safe(values)
    for sample in samples:
        sample.metadata.update(safe)


def mark(
    samples: Sequence[common_pb2.Sample], status: common_pb2.SampleStatus, reason: str, error: str | None = None
) -> None:
    """Sets every sample's status and records why (and the error text, truncated) in its metadata."""
    values: dict[str, Any] = {"status_reason": reason}
    if error:
        values["error"] = error[:MAX_ERROR_CHARS]
    for sample in samples:
        sample.status = status
    update_metadata(samples, values)


def weight_versions(samples: Iterable[common_pb2.Sample]) -> set[int]:
    return {int(span.weight_version) for sample in samples for span in sample.weight_versions}


def fold_spans_to_oldest(sample: common_pb2.Sample) -> None:
    """One span from the first span's start to the last span's end, at the oldest version (policy `keep`)."""
    spans = list(sample.weight_versions)
    if len(spans) <= 1:
        return
    oldest = min(int(span.weight_version) for span in spans)
    start, end = spans[0].start, spans[-1].end
    del sample.weight_versions[:]
    sample.weight_versions.add(start=start, end=end, weight_version=oldest)


def put_turn_rewards(sample: common_pb2.Sample, turn_rewards: Sequence[float]) -> bool:
    """Each turn's reward on the last token of its span (token_rewards, aligned with loss_mask).

    False (nothing set) when the number of rewards differs from the sample's number of spans (turns)."""
    spans = list(sample.weight_versions)
    if len(spans) != len(turn_rewards) or not spans:
        return False
    token_rewards = [0.0] * len(sample.loss_mask)
    for span, reward in zip(spans, turn_rewards, strict=True):
        token_rewards[span.end - 1] = float(reward)
    del sample.token_rewards[:]
    sample.token_rewards.extend(token_rewards)
    return True


def num_response_tokens(sample: common_pb2.Sample) -> int:
    return len(sample.tokens) - sample.response_start
