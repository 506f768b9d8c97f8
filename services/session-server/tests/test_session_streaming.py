"""Streamed turns pass through: the agent's first token arrives while the engine still generates, the turn is
committed only when the engine's stream ends (the same record as a non-streamed turn), a failure mid-stream or a
client that goes away commits nothing, and routing rows never reach a chunk.

The timing checks need real HTTP on both sides (an in-process ASGI client buffers whole responses): the session
service runs under uvicorn in a thread, in front of `HeldEngine`, a test-code SGLang-protocol /generate that sends
its first chunks and then holds the stream open until the test releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from miles.common.testing import free_port

QWEN3_EOS_ID = 151645
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class HeldEngine:
    """/generate streaming `text` as cumulative SGLang chunks: `num_before_hold` chunks, then it waits for
    `release`; `mode` then decides the end: "finish" (the rest, the final chunk, [DONE]), "break" (the connection
    drops), "error_event" (an SGLang error event)."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self.text = "Streaming works, one token at a time, as the engine samples them."
        self.num_before_hold = 3
        self.mode = "finish"
        self.release = threading.Event()
        self.num_finished = 0
        self.num_cancelled = 0

    def _chunk(self, prompt: list[int], ids: list[int], finish: Any) -> str:
        meta = {
            "id": "rid",
            "finish_reason": finish,
            "weight_version": "5",
            "prompt_tokens": len(prompt),
            "cached_tokens": 0,
            "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.25, t, None] for t in ids],
        }
        return f"data: {json.dumps({'text': self.codec.decode(ids), 'output_ids': ids, 'meta_info': meta})}\n\n"

    async def _events(self, prompt: list[int]) -> Any:
        ids = [*self.codec.encode(self.text), QWEN3_EOS_ID]
        finished = False
        try:
            for n in range(1, self.num_before_hold + 1):
                yield self._chunk(prompt, ids[:n], None)
            await asyncio.to_thread(self.release.wait, 30)  # cancellable here: the client going away ends it
            if self.mode == "break":
                raise RuntimeError("the engine died mid-stream")
            if self.mode == "error_event":
                yield 'data: {"error": {"message": "scheduler crashed", "code": 500}}\n\n'
                finished = True
                return
            for n in range(self.num_before_hold + 1, len(ids)):
                yield self._chunk(prompt, ids[:n], None)
            yield self._chunk(prompt, ids, {"type": "stop", "matched": QWEN3_EOS_ID})
            yield "data: [DONE]\n\n"
            finished = True
            self.num_finished += 1
        finally:
            if not finished and self.mode == "finish":
                self.num_cancelled += 1

    def app(self) -> Starlette:
        async def generate(request: Request) -> StreamingResponse:
            body = await request.json()
            return StreamingResponse(self._events(body["input_ids"]), media_type="text/event-stream")

        return Starlette(routes=[Route("/generate", generate, methods=["POST"])])


@pytest.fixture
def held_stack(qwen3_codec: Any, qwen3_model_dir: Path, shared_models: Any, operator_token: str) -> Iterator[Any]:
    from miles.common.telemetry import Metrics
    from miles.session.main import build_service
    from miles.session.settings import SessionSettings

    engine = HeldEngine(qwen3_codec)
    with serve_in_thread(engine.app()) as engine_url:
        settings = SessionSettings(
            store_backend="memory",
            upstream_url=engine_url,
            operator_token=operator_token,
            default_model_path=str(qwen3_model_dir),
            default_model_family="qwen3",
        )
        with serve_in_thread(build_service(settings, Metrics("session"), models=shared_models)) as url:
            try:
                yield engine, httpx.Client(base_url=url, timeout=10)
            finally:
                engine.release.set()


def create(client: httpx.Client, operator_token: str) -> tuple[str, dict[str, str]]:
    created = client.post("/v1/sessions", json={}, headers={"authorization": f"Bearer {operator_token}"}).json()
    return created["session_id"], {"authorization": f"Bearer {created['token']}"}


def events_of(lines: Any) -> list[Any]:
    """The data of each SSE event (`[DONE]` as the string)."""
    return [line[len("data: ") :] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line]


USER = {"role": "user", "content": "Tell me something."}


def test_first_token_reaches_the_agent_while_the_engine_still_generates(held_stack: Any, operator_token: str) -> None:
    engine, client = held_stack
    sid, auth = create(client, operator_token)
    body = {"messages": [USER], "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        early = []
        for line in lines:  # a read timeout (10 s) fails the test if the server waits for the engine's end
            early.append(line)
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        assert engine.num_finished == 0 and not engine.release.is_set()
        assert client.get(f"/v1/sessions/{sid}", headers=auth).json()["num_turns"] == 0  # not committed yet
        engine.release.set()
        events = events_of([*early, *lines])
    assert events[-1] == "[DONE]" and engine.num_finished == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    view = client.get(f"/v1/sessions/{sid}", headers=auth).json()
    assert view["num_turns"] == 1 and view["messages"][-1] == {"role": "assistant", "content": content}
    assert content == engine.text
    finish = chunks[-1]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["miles"]["recorded"] is True
    assert finish["miles"]["weight_version"] == "5" and events[-2]["usage"]["completion_tokens"] > 0
    assert view["records"][0]["logprobs"] == [-0.25] * len(view["records"][0]["completion_ids"])
    metrics = client.get("/metrics").text
    assert "miles_session_stream_first_token_seconds_count 1.0" in metrics


@pytest.mark.parametrize(("mode", "code"), [("break", "upstream_unavailable"), ("error_event", "upstream_malformed")])
def test_a_failure_mid_stream_is_an_error_event_and_commits_nothing(
    held_stack: Any, operator_token: str, mode: str, code: str
) -> None:
    engine, client = held_stack
    engine.mode = mode
    engine.release.set()
    sid, auth = create(client, operator_token)
    body = {"messages": [USER], "stream": True}
    response = client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
    assert response.status_code == 200
    events = events_of(response.text.split("\n\n"))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == code
    assert not any(e["choices"][0]["finish_reason"] for e in events[:-2])  # no finish chunk
    assert client.get(f"/v1/sessions/{sid}", headers=auth).json()["num_turns"] == 0
    metrics = client.get("/metrics").text
    assert 'miles_session_stream_interruptions_total{reason="upstream_error"} 1.0' in metrics
    assert 'miles_session_turns_total{result="failed"} 1.0' in metrics
    engine.mode = "finish"  # the agent retries the same request
    retried = client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
    assert events_of(retried.text.split("\n\n"))[-1] == "[DONE]"
    assert client.get(f"/v1/sessions/{sid}", headers=auth).json()["num_turns"] == 1


def test_a_client_that_goes_away_aborts_the_generation_and_commits_nothing(
    held_stack: Any, operator_token: str
) -> None:
    engine, client = held_stack
    sid, auth = create(client, operator_token)
    body = {"messages": [USER], "stream": True}
    with client.stream("POST", f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while engine.num_cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_cancelled == 1  # the session server closed its upstream request: the engine aborts
    engine.release.set()
    time.sleep(0.2)
    assert client.get(f"/v1/sessions/{sid}", headers=auth).json()["num_turns"] == 0 and engine.num_finished == 0
    metrics = client.get("/metrics").text
    assert 'miles_session_stream_interruptions_total{reason="client_disconnect"} 1.0' in metrics


@pytest.mark.integration
async def test_a_streamed_turn_commits_what_a_non_streamed_one_does(
    make_session_app: Any, fake_engine_url: str, operator_token: str
) -> None:
    """Against the real `miles-engine --fake-model` (greedy, deterministic): the same request streamed and not."""
    op = {"authorization": f"Bearer {operator_token}"}
    views, messages = [], []
    async with make_session_app(fake_engine_url) as client:
        for stream in (False, True):
            created = (await client.post("/v1/sessions", json={}, headers=op)).json()
            sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
            body = {"messages": [USER], "max_tokens": 24, "temperature": 0, "seed": 7, "stream": stream}
            reply = await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
            assert reply.status_code == 200, reply.text
            if stream:
                chunks = [e for e in events_of(reply.text.split("\n\n"))[:-1] if e["choices"]]
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
                messages.append({"role": "assistant", "content": text})
            else:
                messages.append(reply.json()["choices"][0]["message"])
            views.append((await client.get(f"/v1/sessions/{sid}", headers=auth)).json())
    plain, streamed = views
    assert streamed["accumulated_token_ids"] == plain["accumulated_token_ids"]
    assert messages[0] == messages[1] == plain["messages"][-1] == streamed["messages"][-1]
    skip = ("created_at_unix_ms", "upstream_latency_s", "cached_tokens")
    assert [{k: v for k, v in r.items() if k not in skip} for r in streamed["records"]] == [
        {k: v for k, v in r.items() if k not in skip} for r in plain["records"]
    ]
    assert streamed["records"][0]["logprobs"] and len(streamed["records"][0]["completion_ids"]) > 1


async def test_a_streamed_tool_call_turn_keeps_routing_out_of_every_chunk(
    make_session_app: Any, scripted_engine: Any, operator_token: str, qwen3_moe_model_dir: Path, weather_tools: Any
) -> None:
    scripted_engine.script = [f"Let me check.\n{TOOL_CALL_TEXT}"]
    op = {"authorization": f"Bearer {operator_token}"}
    async with make_session_app(scripted_engine.url) as client:
        config = {"model_path": str(qwen3_moe_model_dir), "model_family": "qwen3"}
        assert (await client.put("/v1/jobs/job-1/config", json=config, headers=op)).json()["record_routing"] is True
        created = (await client.post("/v1/sessions", json={"job_id": "job-1"}, headers=op)).json()
        sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
        body = {"messages": [USER], "tools": weather_tools, "stream": True, "return_routed_experts": True}
        reply = await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
        metrics = (await client.get("/metrics")).text
    assert "routed_experts" in json.dumps(scripted_engine.responses) and "routed" not in reply.text
    chunks = [e for e in events_of(reply.text.split("\n\n"))[:-1] if e["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    stored = view["messages"][-1]
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == stored["tool_calls"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "miles_session_routing_stored_bytes_total 0.0" not in metrics
