"""The turn flow in-process (memory store, scripted SGLang-protocol engine): TITO prefix, records, tool calls,
retry rollback, concurrent turns (both also on the Redis store, whose appending phase 1 takes no lock), the Redis
round trips of a turn, streaming, and that every refusal leaves the session usable."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def create(client: httpx.AsyncClient, operator_token: str, **body: Any) -> tuple[str, dict[str, str]]:
    response = await client.post("/v1/sessions", json=body, headers={"authorization": f"Bearer {operator_token}"})
    assert response.status_code == 201, response.text
    data = response.json()
    assert data["base_url"].endswith(f"/v1/sessions/{data['session_id']}/v1")
    return data["session_id"], {"authorization": f"Bearer {data['token']}"}


async def chat(client: httpx.AsyncClient, sid: str, auth: dict[str, str], messages: list[Any], **kw: Any) -> Any:
    return await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json={"messages": messages, **kw}, headers=auth)


async def test_turns_extend_the_token_buffer_and_are_recorded(
    make_session_app: Any, scripted_engine: Any, operator_token: str, weather_tools: list[Any]
) -> None:
    scripted_engine.script = [TOOL_CALL_TEXT, "It is sunny in Paris."]
    async with make_session_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token)
        history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await chat(client, sid, auth, history, tools=weather_tools, max_tokens=64)
        assert first.status_code == 200, first.text
        choice = first.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert first.json()["miles"]["recorded"] is True
        history += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 24C"}]
        second = await chat(client, sid, auth, history, max_tokens=64)  # tools omitted: the first turn's hold
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["message"]["content"] == "It is sunny in Paris."
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0

        prompts = [r["body"]["input_ids"] for r in scripted_engine.requests]
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
    first_ids = view["records"][0]["completion_ids"]
    assert prompts[1][: len(prompts[0]) + len(first_ids)] == prompts[0] + first_ids  # TITO: prefix kept
    assert view["accumulated_token_ids"] == prompts[1] + view["records"][1]["completion_ids"]
    assert view["num_turns"] == 2 and view["version"] == 2
    assert view["tito_session_mismatch"]["num_critical"] == 0
    headers = scripted_engine.requests[0]["headers"]
    assert headers["x-smg-routing-key"] == sid and headers["x-miles-pool"] == "pool-a"
    assert scripted_engine.requests[0]["body"]["return_logprob"] is True


def store_settings(store: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    """make_session_app overrides for `store`: the memory store, or the Redis store on the real test Redis (its own
    key prefix per test)."""
    if store == "memory":
        return {}
    prefix = "t-" + request.node.name.replace("[", "-").rstrip("]")
    return {"store_backend": "redis", "redis_url": request.getfixturevalue("redis_url"), "key_prefix": prefix}


STORES = ["memory", pytest.param("redis", marks=pytest.mark.integration)]


@pytest.mark.parametrize("store", STORES)
async def test_retry_rolls_back_one_turn_but_not_two(
    make_session_app: Any, scripted_engine: Any, operator_token: str, store: str, request: pytest.FixtureRequest
) -> None:
    scripted_engine.script = ["One.", "Two.", "Three.", "Again."]
    async with make_session_app(scripted_engine.url, **store_settings(store, request)) as client:
        sid, auth = await create(client, operator_token)
        h1 = [{"role": "user", "content": "a"}]
        r1 = (await chat(client, sid, auth, h1)).json()["choices"][0]["message"]
        h2 = [*h1, r1, {"role": "user", "content": "b"}]
        r2 = (await chat(client, sid, auth, h2)).json()["choices"][0]["message"]
        h3 = [*h2, r2, {"role": "user", "content": "c"}]
        assert (await chat(client, sid, auth, h3)).status_code == 200
        retry = await chat(client, sid, auth, [*h2, r2, {"role": "user", "content": "c, rephrased"}])
        assert retry.status_code == 200 and retry.json()["miles"]["turn_index"] == 2
        too_deep = await chat(client, sid, auth, [*h1, {"role": "user", "content": "edited"}])
        assert too_deep.status_code == 400
        assert too_deep.json()["error"]["code"] == "tito_non_append_history"
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
    assert view["num_turns"] == 3 and view["messages"][-2]["content"] == "c, rephrased"
    assert view["tito_session_mismatch"]["num_critical"] == 0


@pytest.mark.parametrize("store", STORES)
async def test_concurrent_turns_on_one_session_record_exactly_one(
    make_session_app: Any, scripted_engine: Any, operator_token: str, store: str, request: pytest.FixtureRequest
) -> None:
    scripted_engine.hold_answers_until = 4  # every turn reads the session before any commits
    async with make_session_app(scripted_engine.url, **store_settings(store, request)) as client:
        sid, auth = await create(client, operator_token)
        history = [{"role": "user", "content": "hi"}]
        replies = await asyncio.gather(*(chat(client, sid, auth, history) for _ in range(4)))
        assert [r.status_code for r in replies] == [200] * 4
        recorded = [r.json()["miles"]["recorded"] for r in replies]
        assert recorded.count(True) == 1
        assert {r.json()["miles"]["not_recorded_reason"] for r in replies if not r.json()["miles"]["recorded"]} == {
            "concurrent_turn"
        }
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
        assert view["num_turns"] == 1 and view["num_not_recorded_turns"] == 3
        message = view["messages"][-1]
        assert (
            await chat(client, sid, auth, [*history, message, {"role": "user", "content": "more"}])
        ).status_code == 200


def command_calls(redis_url: str) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT (commands run by scripts included)."""
    import redis

    with redis.Redis.from_url(redis_url) as client:
        stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


@pytest.mark.integration
async def test_an_appending_turn_costs_two_redis_round_trips_and_a_rollback_takes_the_lock(
    make_session_app: Any, scripted_engine: Any, operator_token: str, redis_url: str
) -> None:
    import redis

    scripted_engine.script = ["One.", "Two.", "Three."]
    async with make_session_app(scripted_engine.url, store_backend="redis", redis_url=redis_url) as client:
        sid, auth = await create(client, operator_token)
        h1 = [{"role": "user", "content": "a"}]
        r1 = (await chat(client, sid, auth, h1)).json()["choices"][0]["message"]
        with redis.Redis.from_url(redis_url) as admin:
            admin.config_resetstat()
        h2 = [*h1, r1, {"role": "user", "content": "b"}]
        assert (await chat(client, sid, auth, h2)).json()["miles"]["recorded"] is True
        appended = command_calls(redis_url)
        with redis.Redis.from_url(redis_url) as admin:
            admin.config_resetstat()
        retry = await chat(client, sid, auth, [*h1, r1, {"role": "user", "content": "b, rephrased"}])
        assert retry.json()["miles"]["recorded"] is True and retry.json()["miles"]["turn_index"] == 1
        await asyncio.sleep(0.05)  # the lock's release is sent in the background
        rolled_back = command_calls(redis_url)
    # auth + state in one HMGET, then the fenced commit script; no lock taken (SET NX) and nothing else read
    assert appended.get("hmget") == 1 and appended.get("evalsha") == 1, appended
    assert "set" not in appended and "lrange" not in appended, appended
    # a rollback keeping one record reads state and records under the lock: lock-and-load, release, commit
    assert rolled_back.get("evalsha") == 3 and rolled_back.get("set") == 1 and rolled_back.get("lrange") == 1


@pytest.mark.parametrize("delta_stream", [False, True])
async def test_streamed_turn_is_valid_sse_adding_up_to_the_stored_message(
    make_session_app: Any, scripted_engine: Any, operator_token: str, weather_tools: list[Any], delta_stream: bool
) -> None:
    scripted_engine.script = [TOOL_CALL_TEXT]
    scripted_engine.delta_stream = delta_stream
    async with make_session_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token)
        history = [{"role": "user", "content": "Weather?"}]
        response = await chat(
            client, sid, auth, history, tools=weather_tools, stream=True, stream_options={"include_usage": True}
        )
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]"[len("data: ") :]
        chunks = [json.loads(e) for e in events[:-1]]
        calls = [c for chunk in chunks for choice in chunk["choices"] for c in choice["delta"].get("tool_calls", [])]
        finish = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"] if choice["finish_reason"]]
        assert finish == ["tool_calls"] and chunks[-1]["usage"]["completion_tokens"] > 0
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
    stored = view["messages"][-1]["tool_calls"][0]
    assert [{k: v for k, v in c.items() if k != "index"} for c in calls] == [stored]
    assert scripted_engine.requests[0]["body"]["stream"] is True
    assert view["records"][0]["completion_ids"] == view["accumulated_token_ids"][view["records"][0]["prompt_len"] :]


async def test_turn_traces_its_three_phases_and_counts_prefix_hits(
    make_session_app: Any, scripted_engine: Any, operator_token: str, span_exporter: Any
) -> None:
    async with make_session_app(scripted_engine.url) as client:
        sid, auth = await create(client, operator_token)
        history: list[Any] = [{"role": "user", "content": "a"}]
        reply = await chat(client, sid, auth, history)
        history += [reply.json()["choices"][0]["message"], {"role": "user", "content": "b"}]
        assert (await chat(client, sid, auth, history)).status_code == 200
        metrics = (await client.get("/metrics")).text
    spans = {s.name: s for s in span_exporter.get_finished_spans() if s.name.startswith("session.")}
    assert set(spans) == {"session.prepare", "session.upstream", "session.commit"}
    assert spans["session.upstream"].attributes["miles.session_id"] == sid
    assert spans["session.upstream"].attributes["miles.weight_version"] == "3"
    trace_id = format(spans["session.upstream"].context.trace_id, "032x")
    assert scripted_engine.requests[-1]["headers"]["traceparent"].split("-")[1] == trace_id

    def value(name: str) -> float:
        return float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith(name)))

    prompt_tokens = sum(len(r["body"]["input_ids"]) for r in scripted_engine.requests)
    assert value("miles_session_prompt_tokens_total") == prompt_tokens
    assert 0 < value("miles_session_cached_tokens_total") < prompt_tokens  # hit rate = cached / prompt
    assert value('miles_session_turns_total{result="recorded"}') == 2


async def test_openapi_publishes_the_request_bodies_and_models_lists_the_policy(
    make_session_app: Any, scripted_engine: Any, operator_token: str
) -> None:
    async with make_session_app(scripted_engine.url) as client:
        spec = (await client.get("/openapi.json")).json()
        sid, auth = await create(client, operator_token)
        models = (await client.get(f"/v1/sessions/{sid}/v1/models", headers=auth)).json()
    chat_body = spec["paths"]["/v1/sessions/{session_id}/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in chat_body["content"]["application/json"]["schema"]["properties"]
    assert "model_path" in str(spec["paths"]["/v1/jobs/{job_id}/config"]["put"]["requestBody"])
    assert models["data"][0]["id"] == "qwen3-tokenizer"
