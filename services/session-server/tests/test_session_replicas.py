"""Acceptance: replicas are stateless. A session created on one replica continues on another, turn by turn, with
results identical to the same conversation on a single replica (real Redis, real subprocesses, and the real
`miles-engine --fake-model`, whose greedy sampling and logprobs are a deterministic function of the prompt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

USER_TURNS = ["Plan a trip to Rome.", "Make it cheaper.", "Now in one line."]


def converse(urls: list[str], operator_token: str) -> dict[str, Any]:
    """The conversation, turn i on replica urls[i % len(urls)]; returns its replies, session view and samples."""
    op = {"authorization": f"Bearer {operator_token}"}
    created = httpx.post(f"{urls[0]}/v1/sessions", json={"episode_id": "e"}, headers=op, timeout=60).json()
    sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
    history: list[dict[str, Any]] = []
    replies = []
    for turn, text in enumerate(USER_TURNS):
        history.append({"role": "user", "content": text})
        url = urls[turn % len(urls)]
        body = {"messages": history, "max_tokens": 16, "temperature": 0, "stream": turn == 1}
        response = httpx.post(f"{url}/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert response.status_code == 200, response.text
        if turn == 1:
            chunks = [line for line in response.text.split("\n\n") if line.startswith("data: {")]
            deltas = [json.loads(chunk[len("data: ") :])["choices"] for chunk in chunks]
            content = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
            message = {"role": "assistant", "content": content}
        else:
            message = response.json()["choices"][0]["message"]
        replies.append(message)
        history.append(message)
    last = urls[-1]
    view = httpx.get(f"{last}/v1/sessions/{sid}", headers=auth, timeout=60).json()
    samples = httpx.post(f"{last}/v1/sessions/{sid}/samples", json={"mode": "per_turn"}, headers=auth, timeout=60)
    assert httpx.delete(f"{urls[0]}/v1/sessions/{sid}", headers=auth, timeout=60).status_code == 204
    assert httpx.get(f"{last}/v1/sessions/{sid}", headers=auth, timeout=60).status_code == 404
    return {"replies": replies, "view": view, "samples": samples.json()["samples"]}


def comparable(result: dict[str, Any]) -> dict[str, Any]:
    """Everything but ids, timestamps and cache counters (the second run finds the first one's prefixes)."""
    view = result["view"]
    records = [
        {k: v for k, v in r.items() if k not in ("created_at_unix_ms", "upstream_latency_s", "cached_tokens")}
        for r in view["records"]
    ]
    samples = [
        {k: v for k, v in s.items() if k not in ("metadata", "sample_id", "episode_id")} for s in result["samples"]
    ]
    return {
        "replies": result["replies"],
        "messages": view["messages"],
        "ids": view["accumulated_token_ids"],
        "records": records,
        "samples": samples,
        "version": view["version"],
    }


@pytest.mark.integration
def test_two_replicas_behind_one_redis_match_a_single_replica(
    fake_engine_url: str,
    start_process: Any,
    session_server_argv: list[str],
    session_env: Any,
    redis_url: str,
    qwen3_model_dir: Path,
    operator_token: str,
) -> None:
    env = session_env(redis_url, fake_engine_url, qwen3_model_dir)
    with start_process(session_server_argv, env) as replica_a, start_process(session_server_argv, env) as replica_b:
        single = converse([replica_a], operator_token)
        alternating = converse([replica_a, replica_b], operator_token)
    assert comparable(alternating) == comparable(single)
    assert len(single["view"]["records"]) == len(USER_TURNS) and single["view"]["num_not_recorded_turns"] == 0
    assert len(single["samples"]) == 3 and all(len(s["loss_mask"]) > 0 for s in single["samples"])
    assert all(reply["content"] for reply in single["replies"])
