"""Acceptance: the official `openai` client, used as clients use it, against a real miles-session-server process
(Redis) in front of a real `miles-engine` serving the tiny Qwen3 model with a 512-token context.

Every call of the matrix must succeed with a completion inside the context: the client's defaults (no
max_tokens), streaming, tools, `client.with_options(...)`, and max_tokens / max_completion_tokens far beyond the
context (clamped, reported in a header). A recording proxy in the router's place shows the engine got exactly
context - prompt - 1 as max_new_tokens (the largest it accepts)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from miles.common.testing.smoke import console_script

pytestmark = pytest.mark.integration
CONTEXT_TOKENS = 512
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def stack(
    redis_server: Any,
    start_process: Any,
    tiny_model_dir: Path,
    recording_proxy_class: Any,
    session_server_argv: list[str],
    session_env: Any,
    qwen3_model_dir: Path,
) -> Iterator[tuple[str, Any]]:
    """(session server URL, the recording proxy in front of the engine)."""
    context = str(CONTEXT_TOKENS)
    engine_argv = [console_script("miles-engine"), "--model-path", str(tiny_model_dir), "--port", "{port}"]
    with start_process([*engine_argv, "--context-length", context]) as engine_url:
        proxy = recording_proxy_class(engine_url).start()
        env = session_env(
            redis_server.url, proxy.url, qwen3_model_dir, MILES_SESSION_DEFAULT_MAX_CONTEXT_TOKENS=context
        )
        try:
            with start_process(session_server_argv, env) as server_url:
                yield server_url, proxy
        finally:
            proxy.stop()


def new_client(server_url: str, operator_token: str) -> OpenAI:
    created = httpx.post(
        f"{server_url}/v1/sessions", json={}, headers={"authorization": f"Bearer {operator_token}"}, timeout=60
    )
    assert created.status_code == 201, created.text
    return OpenAI(base_url=created.json()["base_url"], api_key=created.json()["token"], max_retries=0)


def plain(client: OpenAI, weather_tools: Any) -> tuple[Any, dict[str, str]]:
    return client.chat.completions.create(model="policy", messages=MESSAGES), {}


def tools(client: OpenAI, weather_tools: Any) -> tuple[Any, dict[str, str]]:
    reply = client.chat.completions.create(model="policy", messages=MESSAGES, tools=weather_tools, tool_choice="auto")
    return reply, {}


def with_options(client: OpenAI, weather_tools: Any) -> tuple[Any, dict[str, str]]:
    configured = client.with_options(timeout=120.0, max_retries=2)
    return configured.chat.completions.create(model="policy", messages=MESSAGES, temperature=0.7), {}


def huge(field: str, value: int) -> Callable[[OpenAI, Any], tuple[Any, dict[str, str]]]:
    def call(client: OpenAI, weather_tools: Any) -> tuple[Any, dict[str, str]]:
        raw = client.chat.completions.with_raw_response.create(model="policy", messages=MESSAGES, **{field: value})
        return raw.parse(), dict(raw.headers)

    return call


def streaming(client: OpenAI, weather_tools: Any) -> tuple[Any, dict[str, str]]:
    """The stream, as a client reads it: content deltas, a finish reason, then the usage chunk."""
    stream = client.chat.completions.create(
        model="policy",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return {"text": text, "finish": finish, "usage": usage}, {}


MATRIX: dict[str, Callable[[OpenAI, Any], tuple[Any, dict[str, str]]]] = {
    "client defaults (no max_tokens)": plain,
    "streaming": streaming,
    "tools": tools,
    "with_options": with_options,
    "max_tokens huge": huge("max_tokens", 10**9),
    "max_completion_tokens huge": huge("max_completion_tokens", 10**6),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_the_openai_client_gets_a_completion_within_the_context(
    stack: tuple[str, Any], operator_token: str, weather_tools: Any, case: str
) -> None:
    server_url, proxy = stack
    reply, headers = MATRIX[case](new_client(server_url, operator_token), weather_tools)
    if case == "streaming":
        usage, finish = reply["usage"], reply["finish"]
        assert reply["text"]
    else:
        usage, finish = reply.usage, reply.choices[0].finish_reason
        assert reply.choices[0].message.role == "assistant"
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.prompt_tokens + usage.completion_tokens < CONTEXT_TOKENS
    sent = proxy.requests[-1]["body"]
    assert len(sent["input_ids"]) == usage.prompt_tokens
    assert sent["sampling_params"]["max_new_tokens"] == CONTEXT_TOKENS - usage.prompt_tokens - 1
    if case.endswith("huge"):
        assert int(headers["x-miles-max-tokens-clamped-from"]) in (10**9, 10**6)
        assert headers["x-miles-max-new-tokens"] == str(CONTEXT_TOKENS - usage.prompt_tokens - 1)
