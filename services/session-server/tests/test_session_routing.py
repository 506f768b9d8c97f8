"""Acceptance of Rollout Routing Replay (R3) in sessions: a real miles-session-server (Redis) in front of a real
`miles-engine --enable-return-routed-experts` serving the tiny Qwen3-MoE model (4 MoE layers, 8 experts, top-2),
with a recording proxy in the router's place. A tree session's paths (forks and a compacted root) carry routing the
same way.

A multi-turn session (a tool message and user messages between turns, a streamed turn, a retried turn) must give
samples whose routing is exactly what one fresh `/generate` over each sample's whole token list computes on a
flushed cache (merge, per_turn and a max_seq_len cut); each turn must have asked only for the rows the session did
not hold (checked against what the engine was sent and answered); the agent never sees routing; a dense job asks
for none and gets none, and `record_routing: true` for it is refused.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.contracts.routing import unpack
from miles.common.contracts.samples import sample_problem
from miles.common.testing.smoke import console_script
from miles.proto.common.v1 import common_pb2
from miles.proto.session.v1 import session_pb2

pytestmark = pytest.mark.integration

ROW_WIDTH = 4 * 2  # MoE layers x top_k of the tiny model: uint8 ids, so also bytes per row


@dataclass
class Stack:
    engine_url: str
    proxy: Any
    server_url: str
    op: dict[str, str]


@pytest.fixture
def stack(
    start_process: Any,
    tiny_moe_model_dir: Path,
    recording_proxy_class: Any,
    session_server_argv: list[str],
    session_env: Any,
    redis_url: str,
    operator_token: str,
) -> Iterator[Stack]:
    engine_argv = [console_script("miles-engine"), "--model-path", str(tiny_moe_model_dir), "--port", "{port}"]
    engine_argv += ["--deterministic", "--enable-return-routed-experts"]
    with start_process(engine_argv) as engine_url:
        proxy = recording_proxy_class(engine_url).start()
        try:
            env = session_env(redis_url, proxy.url, tiny_moe_model_dir)
            with start_process(session_server_argv, env) as server_url:
                yield Stack(engine_url, proxy, server_url, {"authorization": f"Bearer {operator_token}"})
        finally:
            proxy.stop()


def put_job(stack: Stack, job_id: str, model_dir: Path, **extra: Any) -> httpx.Response:
    body = {"model_path": str(model_dir), "model_family": "qwen3", **extra}
    return httpx.put(f"{stack.server_url}/v1/jobs/{job_id}/config", json=body, headers=stack.op, timeout=60)


def create(stack: Stack, job_id: str) -> tuple[str, dict[str, str]]:
    reply = httpx.post(f"{stack.server_url}/v1/sessions", json={"job_id": job_id}, headers=stack.op, timeout=60)
    assert reply.status_code == 201, reply.text
    return reply.json()["session_id"], {"authorization": f"Bearer {reply.json()['token']}"}


def chat(stack: Stack, sid: str, auth: dict[str, str], messages: list[Any], **extra: Any) -> tuple[str, Any]:
    """(the raw answer text, the assistant message) of one turn, streamed or not."""
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.0, **extra}
    reply = httpx.post(
        f"{stack.server_url}/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth, timeout=120
    )
    assert reply.status_code == 200, reply.text
    if not extra.get("stream"):
        return reply.text, reply.json()["choices"][0]["message"]
    content = ""
    for line in reply.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                content += choice["delta"].get("content") or ""
    return reply.text, {"role": "assistant", "content": content}


def samples(stack: Stack, sid: str, auth: dict[str, str], **body: Any) -> list[Any]:
    reply = httpx.post(
        f"{stack.server_url}/v1/sessions/{sid}/samples",
        json=body,
        headers={**auth, "accept": "application/x-protobuf"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return list(session_pb2.SessionSamples.FromString(reply.content).samples)


def fresh_routing(stack: Stack, tokens: list[int]) -> list[int]:
    """One cold /generate over the whole token list from position 0: its len(tokens) - 1 rows, flat."""
    assert httpx.post(f"{stack.engine_url}/flush_cache", timeout=60).status_code == 200
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0},
        "return_routed_experts": True,
        "routed_experts_start_len": 0,
    }
    reply = httpx.post(f"{stack.engine_url}/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    raw = base64.b64decode(reply.json()["meta_info"]["routed_experts"])
    return [int.from_bytes(raw[i : i + 4], "little", signed=True) for i in range(0, len(raw), 4)]


def run_episode(stack: Stack, sid: str, auth: dict[str, str]) -> list[str]:
    """Five engine calls, four recorded turns: a tool message and users between turns, turn 1 streamed, turn 2
    retried (its rows dropped and asked again); the client asks for routing itself on turn 2 (ignored)."""
    history: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Look up the weather in Paris."},
    ]
    texts = []
    text, message = chat(stack, sid, auth, history)
    texts.append(text)
    history += [message, {"role": "tool", "tool_call_id": "call_0", "content": "Paris: sunny, 24C"}]
    text, message = chat(stack, sid, auth, history, stream=True, stream_options={"include_usage": True})
    texts.append(text)
    history += [message, {"role": "user", "content": "And Rome?"}]
    client_ask = {"return_routed_experts": True, "routed_experts_start_len": 0}
    text, _ = chat(stack, sid, auth, history, **client_ask)
    texts.append(text)
    history[-1] = {"role": "user", "content": "And Rome, in Celsius?"}  # a retry: turn 2 is rolled back
    text, message = chat(stack, sid, auth, history)
    texts.append(text)
    history += [message, {"role": "user", "content": "Thanks."}]
    texts.append(chat(stack, sid, auth, history)[0])
    return texts


def assert_routing_is_the_engines(stack: Stack, sample: Any) -> None:
    assert sample_problem(sample) is None
    routed = sample.rollout_routed_experts
    assert (routed.num_layers, routed.top_k, routed.dtype) == (4, 2, common_pb2.ROUTING_DTYPE_UINT8)
    assert len(routed.data) == (len(sample.tokens) - 1) * ROW_WIDTH
    assert list(unpack(routed)) == fresh_routing(stack, list(sample.tokens))


def test_moe_session_samples_carry_exactly_the_engines_routing(stack: Stack, tiny_moe_model_dir: Path) -> None:
    registered = put_job(stack, "moe", tiny_moe_model_dir)
    assert registered.status_code == 200 and registered.json()["record_routing"] is True  # None: on for MoE
    sid, auth = create(stack, "moe")
    texts = run_episode(stack, sid, auth)
    for text in texts:  # streamed and not: the agent never sees routing
        assert "routed_experts" not in text and "sglext" not in text
    sent = [r["body"] for r in stack.proxy.requests]
    answers = stack.proxy.responses
    seqlens = [len(a["input_ids"]) + len(a["output_ids"]) for a in answers]
    assert len(sent) == len(answers) == 5
    # Turn 0 asks from 0; each later one from its base's last row (the retry from the rolled-back turn's base):
    # only new rows, the prompt tokens injected between turns included.
    assert [b["routed_experts_start_len"] for b in sent] == [
        0,
        seqlens[0] - 1,
        seqlens[1] - 1,
        seqlens[1] - 1,
        seqlens[3] - 1,
    ]
    assert all(b["return_routed_experts"] is True for b in sent)
    for body, answer, seqlen in zip(sent, answers, seqlens, strict=True):
        num_ids = len(base64.b64decode(answer["routed_experts"])) // 4
        assert num_ids == (seqlen - 1 - body["routed_experts_start_len"]) * ROW_WIDTH
    metrics = httpx.get(f"{stack.server_url}/metrics", timeout=30).text
    stored = sum(len(base64.b64decode(a["routed_experts"])) // 4 for a in answers)  # int32 on the wire, 1 byte stored
    assert f"miles_session_routing_stored_bytes_total {float(stored)}" in metrics
    assert "miles_session_routing_row_mismatches_total 0.0" in metrics

    (merged,) = samples(stack, sid, auth, mode="merge")
    assert list(merged.tokens) == answers[-1]["input_ids"] + answers[-1]["output_ids"]
    assert_routing_is_the_engines(stack, merged)
    per_turn = samples(stack, sid, auth, mode="per_turn")
    assert len(per_turn) == 4
    for sample in per_turn:
        assert_routing_is_the_engines(stack, sample)
    cut_at = len(answers[3]["input_ids"]) + 2  # inside the last kept turn's output
    (truncated,) = samples(stack, sid, auth, mode="merge", max_seq_len=cut_at)
    assert truncated.status == common_pb2.SAMPLE_STATUS_TRUNCATED and len(truncated.tokens) == cut_at
    assert_routing_is_the_engines(stack, truncated)


def test_a_dense_job_records_no_routing_and_cannot_ask_for_it(stack: Stack, qwen3_model_dir: Path) -> None:
    refused = put_job(stack, "dense", qwen3_model_dir, record_routing=True)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["field"]) == ("invalid_job_config", "record_routing")
    assert "not a MoE model" in error["message"]
    registered = put_job(stack, "dense", qwen3_model_dir)
    assert registered.status_code == 200 and registered.json()["record_routing"] is False
    sid, auth = create(stack, "dense")
    history = [{"role": "user", "content": "Hello."}]
    text, message = chat(stack, sid, auth, history, return_routed_experts=True)
    assert "routed_experts" not in text
    chat(stack, sid, auth, [*history, message, {"role": "user", "content": "Again."}])
    assert all("return_routed_experts" not in r["body"] for r in stack.proxy.requests)
    assert all(r["routed_experts"] is None for r in stack.proxy.responses)
    for mode in ("merge", "per_turn"):
        for sample in samples(stack, sid, auth, mode=mode):
            assert not sample.HasField("rollout_routed_experts") and sample_problem(sample) is None


def test_every_path_of_a_tree_session_carries_exactly_the_engines_routing(
    stack: Stack, tiny_moe_model_dir: Path
) -> None:
    assert put_job(stack, "moe-tree", tiny_moe_model_dir, tree_sessions=True).status_code == 200
    sid, auth = create(stack, "moe-tree")
    history: list[Any] = [{"role": "user", "content": "Name a colour."}]
    history.append(chat(stack, sid, auth, history)[1])
    for follow_up in ("Another one?", "A darker one?"):  # two forks from the first turn
        chat(stack, sid, auth, [*history, {"role": "user", "content": follow_up}])
    chat(stack, sid, auth, [{"role": "system", "content": "Summary: colours."}, {"role": "user", "content": "More?"}])
    starts = [body["routed_experts_start_len"] for body in (r["body"] for r in stack.proxy.requests)]
    first_seqlen = len(stack.proxy.responses[0]["input_ids"]) + len(stack.proxy.responses[0]["output_ids"])
    assert starts == [0, first_seqlen - 1, first_seqlen - 1, 0]  # forks ask only for their own rows; a new root all
    merged = samples(stack, sid, auth, mode="merge")
    assert len(merged) == 3  # two forks and the compacted root
    for sample in merged:
        assert_routing_is_the_engines(stack, sample)
