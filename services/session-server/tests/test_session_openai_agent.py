"""Acceptance: a multi-turn tool-using agent written with the official `openai` package, against a real
miles-session-server subprocess, a real Redis and an engine speaking SGLang's protocol; then its samples.

Two engines: the real `miles-engine` with the project's tiny Qwen3 model (random weights: it never writes a tool
call, so the agent answers with user follow-ups), and the scripted SGLang-protocol engine whose completions are
real Qwen3 tool calls (parsed into `tool_calls`, executed by the agent, answered with tool messages). A recording
proxy in the router's place sees exactly what each engine consumed and sampled, so the checks do not trust the
session server: tokens = last prompt + its engine ids, each prompt extends the previous prompt + engine ids, the
loss mask is 1 exactly on engine-sampled ids with their engine logprobs, and the comparator finds 0 critical.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from miles.proto.session.v1 import session_pb2

TOOL_CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
SCRIPT = [TOOL_CALL.format(city="Paris"), TOOL_CALL.format(city="Rome"), "Paris is sunny, Rome is rainy.", "Sure."]
NUM_TURNS = 4
STREAMED_TURN = 1


def streamed_message(stream: Any) -> dict[str, Any]:
    """The assistant message an OpenAI client assembles from chat.completion.chunk deltas."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            reasoning = (delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                message["reasoning_content"] = message.get("reasoning_content", "") + reasoning
            for call in delta.tool_calls or []:
                slot = calls.setdefault(
                    call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                slot["id"] += call.id or ""
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def run_agent(base_url: str, token: str, tools: list[Any]) -> list[dict[str, Any]]:
    """A plain OpenAI tool-use loop: call the model, run the tools it asks for, else ask a follow-up."""
    client = OpenAI(base_url=base_url, api_key=token, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You report the weather. Use the tool."},
        {"role": "user", "content": "What is the weather in Paris and in Rome?"},
    ]
    for turn in range(NUM_TURNS):
        request = {"model": "policy", "messages": messages, "tools": tools, "max_tokens": 24, "temperature": 0.0}
        if turn == STREAMED_TURN:
            message = streamed_message(client.chat.completions.create(**request, stream=True))
        else:
            completion = client.chat.completions.create(**request)
            assert completion.usage is not None and completion.usage.completion_tokens > 0
            message = completion.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for call in message.get("tool_calls", []):
            city = json.loads(call["function"]["arguments"])["city"]
            weather = {"Paris": "sunny", "Rome": "rainy"}[city]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{city}: {weather}"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"Thanks. Say it again, differently ({turn})."})
    return messages


@pytest.fixture(params=["miles-engine", "scripted"])
def engine_proxy(
    request: pytest.FixtureRequest,
    start_process: Any,
    tiny_model_dir: Path,
    scripted_engine: Any,
    recording_proxy_class: Any,
) -> Iterator[Any]:
    """What the session server calls: the scripted engine, or a recording proxy in front of a real miles-engine."""
    if request.param == "scripted":
        scripted_engine.script = SCRIPT
        scripted_engine.kind = "scripted"
        yield scripted_engine
        return
    from miles.common.testing.smoke import console_script

    argv = [console_script("miles-engine"), "--model-path", str(tiny_model_dir), "--port", "{port}"]
    with start_process(argv) as engine_url:
        proxy = recording_proxy_class(engine_url).start()
        proxy.kind = "miles-engine"
        yield proxy
        proxy.stop()


@pytest.mark.integration
def test_openai_agent_session_gives_exact_samples(
    engine_proxy: Any,
    start_process: Any,
    session_server_argv: list[str],
    session_env: Any,
    redis_url: str,
    qwen3_model_dir: Path,
    operator_token: str,
    weather_tools: list[Any],
) -> None:
    env = session_env(redis_url, engine_proxy.url, qwen3_model_dir)
    with start_process(session_server_argv, env) as server_url:
        op = {"authorization": f"Bearer {operator_token}"}
        created = httpx.post(
            f"{server_url}/v1/sessions", json={"episode_id": "episode-1"}, headers=op, timeout=60
        ).json()
        history = run_agent(created["base_url"], created["token"], weather_tools)
        auth = {"authorization": f"Bearer {created['token']}"}
        view = httpx.get(f"{server_url}/v1/sessions/{created['session_id']}", headers=auth, timeout=60).json()
        reply = httpx.post(
            f"{server_url}/v1/sessions/{created['session_id']}/samples",
            json={"mode": "merge"},
            headers={**auth, "accept": "application/x-protobuf"},
            timeout=60,
        )
    assert reply.status_code == 200, reply.text
    (sample,) = session_pb2.SessionSamples.FromString(reply.content).samples
    prompts = [r["input_ids"] for r in engine_proxy.responses]
    outputs = [r["output_ids"] for r in engine_proxy.responses]
    logprobs = [r["logprobs"] for r in engine_proxy.responses]
    assert len(prompts) == NUM_TURNS == view["num_turns"]
    if engine_proxy.kind == "scripted":  # the model's tool calls were parsed, the streamed one included, and run
        assistant_turns = [m for m in history if m["role"] == "assistant"]
        assert [len(m.get("tool_calls", [])) for m in assistant_turns] == [1, 1, 0, 0]
        assert [m["content"] for m in history if m["role"] == "tool"] == ["Paris: sunny", "Rome: rainy"]
    for i in range(1, NUM_TURNS):
        assert prompts[i][: len(prompts[i - 1]) + len(outputs[i - 1])] == prompts[i - 1] + outputs[i - 1]
    assert list(sample.tokens) == prompts[-1] + outputs[-1]
    start = sample.response_start
    assert start == len(prompts[0])
    expected_mask = [0] * (len(sample.tokens) - start)
    expected_logprobs = [0.0] * (len(sample.tokens) - start)
    for prompt, output_logprobs in zip(prompts, logprobs, strict=True):
        for offset, logprob in enumerate(output_logprobs):
            expected_mask[len(prompt) - start + offset] = 1
            expected_logprobs[len(prompt) - start + offset] = logprob
    assert list(sample.loss_mask) == expected_mask
    assert list(sample.rollout_logprobs) == pytest.approx(expected_logprobs, abs=1e-6)  # float32 on the wire
    assert sum(s.end - s.start for s in sample.weight_versions) == sum(len(o) for o in outputs)
    assert view["tito_session_mismatch"]["num_critical"] == 0, view["tito_session_mismatch"]
    assert sample.metadata["tito_num_critical"] == 0
    assert all(r["headers"]["x-smg-routing-key"] == created["session_id"] for r in engine_proxy.requests)
    assert engine_proxy.requests[STREAMED_TURN]["body"]["stream"] is True
    assert all(r["cached_tokens"] > 0 for r in engine_proxy.responses[1:])  # the prefix was reused
