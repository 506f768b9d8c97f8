"""Sample assembly: trailing-token trim, merge / per-turn shapes, truncation, placeholders, and the endpoint's
protobuf and JSON encodings of miles.common.v1.Sample."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from google.protobuf import json_format

from miles.proto.common.v1 import common_pb2
from miles.proto.session.v1 import session_pb2
from miles.session import samples_wire
from miles.session.errors import SampleAssemblyError, SampleContractError
from miles.session.records import FinishType, ModelConfig, SessionMeta, TurnRecord
from miles.session.samples import WeightSpanData, build_samples

STOP = 99


def record(index: int, prompt_len: int, output: list[int], finish: FinishType = FinishType.STOP) -> TurnRecord:
    return TurnRecord(
        turn_index=index,
        prompt_len=prompt_len,
        num_trimmed_tokens=0,
        completion_ids=output,
        logprobs=[-0.5 - i for i in range(len(output))],
        weight_version=str(10 + index),
        cached_tokens=prompt_len - 1,
        prompt_tokens=prompt_len,
        finish_type=finish,
        finish_matched=None,
        messages_end=2 * index + 2,
        created_at_unix_ms=0,
        upstream_latency_s=0.0,
    )


# Miles' worked example: the stop token of each turn but the last was replaced by the next prompt's rendering.
ACCUMULATED = [1, 2, 3, 10, 4, 5, 6, 20, 7, 8, 9, 30, STOP]
RECORDS = [record(0, 3, [10, STOP]), record(1, 7, [20, STOP]), record(2, 11, [30, STOP])]


def build(records: list[TurnRecord], ids: list[int], **kw: Any) -> Any:
    args: dict[str, Any] = {"max_trim_tokens": 1, "mode": "merge", "max_seq_len": None, "episode_id": "ep"}
    return build_samples(records, ids, placeholder_token_id=0, **{**args, **kw})


def test_trailing_token_trim_and_merge_masks_exactly_the_sampled_ids() -> None:
    (sample,), empty_reason = build(RECORDS, ACCUMULATED)
    assert empty_reason == "" and sample.status == "COMPLETED"
    assert sample.tokens == ACCUMULATED and sample.response_start == 3
    assert sample.loss_mask == [1, 0, 0, 0, 1, 0, 0, 0, 1, 1]
    assert sample.rollout_logprobs == [-0.5, 0, 0, 0, -0.5, 0, 0, 0, -0.5, -1.5]
    assert [(s.start, s.end, s.weight_version) for s in sample.weight_versions] == [(0, 1, 10), (4, 5, 11), (8, 10, 12)]


def test_a_turn_an_update_split_has_one_span_per_version_in_both_shapes() -> None:
    """The middle turn [4, 5, STOP'] was sampled by version 11 then 13 (a pause carried it across an update): the
    merged sample gets two spans for it, cut where its kept tokens end (the trimmed stop token is not one)."""
    split = dataclasses.replace(
        record(1, 7, [20, 21, STOP]), weight_version="13", weight_version_spans=[(0, 1, "11"), (1, 3, "13")]
    )
    ids = [1, 2, 3, 10, 4, 5, 6, 20, 21, 7, 8, 9, 30, STOP]
    (sample,), _ = build([RECORDS[0], split, record(2, 12, [30, STOP])], ids)
    spans = [(s.start, s.end, s.weight_version) for s in sample.weight_versions]
    assert spans == [(0, 1, 10), (4, 5, 11), (5, 6, 13), (9, 11, 12)]
    per_turn, _ = build([RECORDS[0], split, record(2, 12, [30, STOP])], ids, mode="per_turn")
    assert [(s.start, s.end, s.weight_version) for s in per_turn[1].weight_versions] == [(0, 1, 11), (1, 2, 13)]
    stored = TurnRecord.from_json(json.loads(json.dumps(split.to_json())))
    assert stored == split


def test_per_turn_samples_and_no_trim_for_the_last_turn() -> None:
    samples, _ = build(RECORDS, ACCUMULATED, mode="per_turn")
    assert [(s.tokens, s.response_start, s.loss_mask) for s in samples] == [
        (ACCUMULATED[:4], 3, [1]),
        (ACCUMULATED[:8], 7, [1]),
        (ACCUMULATED, 11, [1, 1]),
    ]
    assert [s.sample_id for s in samples] == ["ep/turn-0", "ep/turn-1", "ep/turn-2"]
    with pytest.raises(SampleAssemblyError, match="first mismatch at buffer index 12"):
        build(RECORDS, ACCUMULATED[:-1])  # the last turn may not be trimmed
    with pytest.raises(SampleAssemblyError, match="allowed trim 0"):
        build(RECORDS, ACCUMULATED, max_trim_tokens=0)


@pytest.mark.parametrize(("label", "version"), [("default", 0), ("v2", 0), ("", 0), ("7", 7)])
def test_span_version_reads_default_as_the_initial_version_and_no_version_as_the_oldest(
    label: str, version: int
) -> None:
    """miles.common.contracts.weight_version: "default" is 0; a label that is no version is recorded as 0 too."""
    (sample,), _ = build([dataclasses.replace(RECORDS[0], weight_version=label)], [1, 2, 3, 10, STOP])
    assert [s.weight_version for s in sample.weight_versions] == [version]


@pytest.mark.parametrize(
    "break_it",
    [
        lambda s: s.loss_mask.append(1),  # the shared Sample contract
        lambda s: s.weight_versions.append(WeightSpanData(0, 99, 1)),  # the shared Sample contract
        lambda s: s.rollout_logprobs.__setitem__(1, -0.25),  # this server's guarantee: 0.0 under a 0 mask
    ],
)
def test_a_built_sample_that_breaks_the_contract_is_refused_when_encoded(break_it: Any) -> None:
    (sample,), _ = build(RECORDS, ACCUMULATED)
    meta = SessionMeta("s-1", "hash", "job-1", "ep", ModelConfig("/m", "qwen3", "p"), {}, 60, 0)
    samples_wire.to_sample(sample, meta, group_id="g", reward=1.0, metadata={})  # as built, it keeps the contract
    break_it(sample)
    with pytest.raises(SampleContractError, match="sample 'ep'"):
        samples_wire.to_sample(sample, meta, group_id="g", reward=1.0, metadata={})


def test_truncation_keeps_whole_turns_then_cuts_inside_the_first_that_overflows() -> None:
    (cut,), _ = build(RECORDS, ACCUMULATED, max_seq_len=12)
    assert cut.status == "TRUNCATED" and cut.tokens == ACCUMULATED[:12] and sum(cut.loss_mask) == 3
    (boundary,), _ = build(RECORDS, ACCUMULATED, max_seq_len=10)
    assert boundary.tokens == ACCUMULATED[:8] and boundary.status == "TRUNCATED"
    (placeholder,), reason = build(RECORDS, ACCUMULATED, max_seq_len=3)
    assert reason == "all_truncated" and placeholder.status == "ABORTED" and len(placeholder.tokens) == 1


def test_max_tokens_cuts_mark_turns_truncated_and_no_records_is_aborted() -> None:
    records = [record(0, 3, [10, STOP]), record(1, 7, [20], FinishType.LENGTH), record(2, 11, [30])]
    ids = [1, 2, 3, 10, 4, 5, 6, 20, 7, 8, 9, 30]
    (middle_cut,), _ = build(records, ids)
    assert middle_cut.status == "COMPLETED" and middle_cut.tokens == ids and sum(middle_cut.loss_mask) == 3
    (last_cut,), _ = build([*records[:2], dataclasses.replace(records[2], finish_type=FinishType.LENGTH)], ids)
    assert last_cut.status == "TRUNCATED"
    assert [s.status for s in build(records, ids, mode="per_turn")[0]] == ["COMPLETED", "TRUNCATED", "COMPLETED"]
    (placeholder,), reason = build([], [])
    assert reason == "no_records" and placeholder.status == "ABORTED"
    assert placeholder.response_start == len(placeholder.tokens) == 1 and placeholder.loss_mask == []


async def test_samples_endpoint_speaks_protobuf_and_json(
    make_session_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    scripted_engine.script = ["First answer.", "Second answer."]
    op = {"authorization": f"Bearer {operator_token}"}
    async with make_session_app(scripted_engine.url) as client:
        created = await client.post("/v1/sessions", json={"episode_id": "ep-1", "metadata": {"task": 7}}, headers=op)
        sid, auth = created.json()["session_id"], {"authorization": f"Bearer {created.json()['token']}"}
        empty = await client.post(f"/v1/sessions/{sid}/samples", headers=auth)
        assert json_format.Parse(empty.text, session_pb2.SessionSamples()).empty_reason == "no_records"
        history: list[Any] = [{"role": "user", "content": "q1"}]
        for follow_up in ("q2", None):
            reply = await client.post(
                f"/v1/sessions/{sid}/v1/chat/completions", json={"messages": history}, headers=auth
            )
            history += [reply.json()["choices"][0]["message"]]
            if follow_up:
                history.append({"role": "user", "content": follow_up})
        body = {"mode": "merge", "reward": 1.5, "group_id": "g-1", "metadata": {"label": "x"}}
        binary = await client.post(
            f"/v1/sessions/{sid}/samples", json=body, headers={**auth, "accept": "application/x-protobuf"}
        )
        as_json = await client.post(f"/v1/sessions/{sid}/samples", json=body, headers=auth)
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
    assert binary.headers["content-type"] == "application/x-protobuf"
    message = session_pb2.SessionSamples.FromString(binary.content)
    assert json_format.Parse(as_json.text, session_pb2.SessionSamples()) == message
    (sample,) = message.samples
    prompts = [r["body"]["input_ids"] for r in scripted_engine.requests]
    outputs = [r["completion_ids"] for r in view["records"]]
    assert list(sample.tokens) == prompts[1] + outputs[1] and sample.response_start == len(prompts[0])
    mask = list(sample.loss_mask)
    assert len(mask) == len(sample.rollout_logprobs) == len(sample.tokens) - sample.response_start
    sampled_positions = [i for i, m in enumerate(mask) if m]
    expected_positions = list(range(len(outputs[0]))) + [
        len(prompts[1]) - len(prompts[0]) + i for i in range(len(outputs[1]))
    ]
    assert sampled_positions == expected_positions
    sampled_logprobs = [lp for lp, m in zip(sample.rollout_logprobs, mask, strict=True) if m]
    for position, logprob in zip(sampled_positions, sampled_logprobs, strict=True):
        assert logprob == pytest.approx(scripted_engine.logprob(sample.response_start + position))
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, mask, strict=True) if not m)
    assert [s.weight_version for s in sample.weight_versions] == [3, 3]
    assert sample.status == common_pb2.SAMPLE_STATUS_COMPLETED and sample.reward == 1.5
    assert sample.group_id == "g-1" and sample.episode_id == "ep-1"
    assert (
        sample.metadata["task"] == 7 and sample.metadata["label"] == "x" and sample.metadata["tito_num_critical"] == 0
    )
    assert message.session_metadata["tito_session_mismatch"]["num_critical"] == 0
