"""LoRA jobs on a shared engine pool, in-process over the scripted SGLang-protocol engine, on the memory store and on
a real Redis: the live adapter's PUT / GET and every refusal, turns (linear and tree) naming it as `lora_path` and
recording its version, the wait for a first version, the retry after a "not loaded" 400, per-job token counters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration  # the redis cases start a redis-server

JOB = "job-lora"
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Settings overrides of the store backend: memory, or a real Redis (flushed before the test)."""
    if request.param == "memory":
        return {}
    return {"store_backend": "redis", "redis_url": request.getfixturevalue("redis_url")}


@pytest.fixture
def lora_app(make_session_app: Any, backend: dict[str, Any]) -> Callable[..., Any]:
    def start(upstream_url: str, **settings: Any) -> Any:
        return make_session_app(upstream_url, **{**backend, **settings})

    return start


@pytest.fixture
def op(operator_token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {operator_token}"}


@pytest.fixture
def put_job(qwen3_model_dir: Path, op: dict[str, str]) -> Callable[..., Any]:
    async def put(client: httpx.AsyncClient, job_id: str = JOB, **fields: Any) -> None:
        body = {"model_path": str(qwen3_model_dir), "model_family": "qwen3", "engine_pool": "shared", **fields}
        response = await client.put(f"/v1/jobs/{job_id}/config", json=body, headers=op)
        assert response.status_code == 200, response.text
        assert response.json()["lora_adapter"] is fields.get("lora_adapter", False)

    return put


def adapter(version: int, job_id: str = JOB) -> dict[str, Any]:
    return {"lora_name": f"{job_id}@{version}", "weight_version": version}


async def session(client: httpx.AsyncClient, op: dict[str, str], **body: Any) -> tuple[str, dict[str, str]]:
    response = await client.post("/v1/sessions", json=body, headers=op)
    assert response.status_code == 201, response.text
    return response.json()["session_id"], {"authorization": f"Bearer {response.json()['token']}"}


async def turn(client: httpx.AsyncClient, sid: str, auth: dict[str, str], messages: list[Any], **kw: Any) -> Any:
    body = {"messages": messages, "max_tokens": 16, **kw}
    return await client.post(f"/v1/sessions/{sid}/v1/chat/completions", json=body, headers=auth)


def metric(text: str, sample: str) -> float:
    """The value of one exposed sample (`name{labels}`), 0 when absent."""
    values = [line.rsplit(" ", 1)[1] for line in text.splitlines() if line.rsplit(" ", 1)[0] == sample]
    return float(values[0]) if values else 0.0


async def test_put_get_and_every_refusal_of_the_live_adapter(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any, backend: dict[str, Any]
) -> None:
    path = f"/v1/jobs/{JOB}/adapter"
    async with lora_app(scripted_engine.url) as client:
        assert (await client.put(path, json=adapter(1), headers=op)).json()["error"]["code"] == "job_not_found"
        await put_job(client, lora_adapter=True)
        await put_job(client, "job-plain")
        none = await client.get(path, headers=op)
        assert none.status_code == 404 and none.json()["error"]["code"] == "adapter_not_found"
        assert (await client.put(path, json=adapter(1))).status_code == 401
        first = await client.put(path, json=adapter(1), headers=op)
        assert first.status_code == 200 and first.json() == adapter(1)
        assert (await client.put(path, json=adapter(1), headers=op)).json() == adapter(1)  # idempotent
        assert (await client.put(path, json=adapter(3), headers=op)).json() == adapter(3)
        regressed = await client.put(path, json=adapter(2), headers=op)
        assert regressed.status_code == 409 and regressed.json()["error"]["code"] == "adapter_version_regressed"
        assert regressed.json()["error"]["details"]["live"] == adapter(3)
        assert (await client.get(path, headers=op)).json() == adapter(3)
        bad_names = [adapter(4, "other-job"), {**adapter(4), "lora_name": f"{JOB}@5"}, {**adapter(4), "lora_name": "x"}]
        for body in bad_names:
            refused = await client.put(path, json=body, headers=op)
            assert refused.status_code == 400 and refused.json()["error"]["field"] == "lora_name", refused.text
        bad_bodies = [
            {"lora_name": f"{JOB}@4"},
            adapter(-1),
            {**adapter(4), "extra": 1},
            {**adapter(4), "weight_version": "4"},
        ]
        for body in bad_bodies:
            assert (await client.put(path, json=body, headers=op)).status_code == 400, body
        plain = await client.put("/v1/jobs/job-plain/adapter", json=adapter(1, "job-plain"), headers=op)
        assert plain.status_code == 409 and plain.json()["error"]["code"] == "adapter_not_enabled"
        if backend:
            import redis.asyncio as aioredis

            store = aioredis.Redis.from_url(backend["redis_url"])
            assert await store.hgetall(f"miles:session:job:{JOB}:adapter") == {
                b"lora_name": b"job-lora@3",
                b"weight_version": b"3",
            }
            await store.aclose()
        assert (await client.delete(f"/v1/jobs/{JOB}/config", headers=op)).status_code == 204
        assert (await client.get(path, headers=op)).status_code == 404  # deleted with its job config
        await put_job(client, lora_adapter=True)
        assert (await client.get(path, headers=op)).status_code == 404
        assert (await client.put(path, json=adapter(1), headers=op)).status_code == 200  # a new job starts over


async def test_turns_name_the_live_adapter_and_record_its_version_not_the_engines(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any
) -> None:
    async with lora_app(scripted_engine.url) as client:
        await put_job(client, lora_adapter=True)
        assert (await client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(1), headers=op)).status_code == 200
        sid, auth = await session(client, op, job_id=JOB)
        first = await turn(client, sid, auth, [USER], lora_path="evil@9", extra_body={"lora_path": "evil@9"})
        assert first.status_code == 200, first.text
        assert first.json()["miles"]["weight_version"] == "1"  # the engine reported "3": the pool's base weights
        assert (await client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(2), headers=op)).status_code == 200
        history = [USER, first.json()["choices"][0]["message"], {"role": "user", "content": "More?"}]
        second = await turn(client, sid, auth, history)
        assert second.status_code == 200 and second.json()["miles"]["weight_version"] == "2"
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
        plain_sid, plain_auth = await session(client, op)
        assert (await turn(client, plain_sid, plain_auth, [USER], lora_path="evil@9")).status_code == 200
    bodies = [r["body"] for r in scripted_engine.requests]
    assert [b.get("lora_path") for b in bodies] == [f"{JOB}@1", f"{JOB}@2", None]  # an agent never picks one
    assert all(r["headers"]["x-miles-pool"] == "shared" for r in scripted_engine.requests[:2])
    assert view["weight_versions"] == ["1", "2"]


async def test_a_tree_session_turn_names_the_live_adapter(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any
) -> None:
    async with lora_app(scripted_engine.url) as client:
        await put_job(client, lora_adapter=True, tree_sessions=True)
        assert (await client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(7), headers=op)).status_code == 200
        sid, auth = await session(client, op, job_id=JOB)
        answered = await turn(client, sid, auth, [USER])
        assert answered.status_code == 200 and answered.json()["miles"]["tree"]["new_root"] is True
        assert answered.json()["miles"]["weight_version"] == "7"
        view = (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()
    assert scripted_engine.requests[0]["body"]["lora_path"] == f"{JOB}@7"
    assert [node["record"]["weight_version"] for node in view["tree"]["nodes"]] == ["7"]


async def test_a_turn_waits_for_the_first_adapter_version(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any
) -> None:
    async with lora_app(scripted_engine.url, adapter_wait_s=30.0) as client:
        await put_job(client, lora_adapter=True)
        sid, auth = await session(client, op, job_id=JOB)

        async def publish_later() -> None:
            await asyncio.sleep(0.5)
            assert scripted_engine.requests == []  # the turn is waiting, not generating
            assert (await client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(0), headers=op)).status_code == 200

        answered, _ = await asyncio.gather(turn(client, sid, auth, [USER]), publish_later())
    assert answered.status_code == 200 and answered.json()["miles"]["weight_version"] == "0"
    assert scripted_engine.requests[0]["body"]["lora_path"] == f"{JOB}@0"


async def test_no_adapter_within_adapter_wait_s_is_a_retryable_503(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any
) -> None:
    async with lora_app(scripted_engine.url, adapter_wait_s=0.5) as client:
        await put_job(client, lora_adapter=True)
        sid, auth = await session(client, op, job_id=JOB)
        started_s = time.monotonic()
        refused = await turn(client, sid, auth, [USER])
        waited_s = time.monotonic() - started_s
        assert (await client.get(f"/v1/sessions/{sid}", headers=auth)).json()["num_turns"] == 0
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "adapter_not_published"
    assert refused.headers["retry-after"] and waited_s >= 0.5
    assert scripted_engine.requests == []


async def test_a_not_loaded_400_is_retried_once_with_the_new_live_adapter(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any
) -> None:
    loop = asyncio.get_running_loop()
    async with lora_app(scripted_engine.url) as client:
        await put_job(client, lora_adapter=True)
        assert (await client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(1), headers=op)).status_code == 200
        scripted_engine.loaded_adapters = {f"{JOB}@1"}

        def switch_while_in_flight(body: dict[str, Any]) -> None:
            """The trainer, between the turn's read and the engine's answer: load v2, set it live, unload v1."""
            if body["lora_path"] != f"{JOB}@1":
                return
            scripted_engine.loaded_adapters = {f"{JOB}@2"}
            put = client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(2), headers=op)
            assert asyncio.run_coroutine_threadsafe(put, loop).result(timeout=30).status_code == 200

        scripted_engine.on_generate = switch_while_in_flight
        sid, auth = await session(client, op, job_id=JOB)
        retried = await turn(client, sid, auth, [USER])
        scripted_engine.on_generate = None
        scripted_engine.loaded_adapters = set()  # nothing loaded and the live adapter did not move: no retry
        not_loaded = await turn(client, sid, auth, [USER, {"role": "assistant", "content": "x"}, USER])
        metrics = (await client.get("/metrics")).text
    assert retried.status_code == 200 and retried.json()["miles"]["weight_version"] == "2"
    assert [r["body"]["lora_path"] for r in scripted_engine.requests] == [f"{JOB}@1", f"{JOB}@2", f"{JOB}@2"]
    assert not_loaded.status_code == 400 and not_loaded.json()["error"]["code"] == "upstream_rejected"
    assert "not loaded" in not_loaded.json()["error"]["message"]
    assert metric(metrics, "miles_session_adapter_retries_total") == 1


async def test_prompt_and_completion_tokens_are_counted_per_job(
    lora_app: Any, scripted_engine: Any, op: dict[str, str], put_job: Any
) -> None:
    async with lora_app(scripted_engine.url) as client:
        await put_job(client, lora_adapter=True)
        await put_job(client, "job-plain")
        assert (await client.put(f"/v1/jobs/{JOB}/adapter", json=adapter(1), headers=op)).status_code == 200
        for job_id in (JOB, JOB, "job-plain"):
            sid, auth = await session(client, op, job_id=job_id)
            assert (await turn(client, sid, auth, [USER])).status_code == 200
        metrics = (await client.get("/metrics")).text
    sent = scripted_engine.requests
    answered = scripted_engine.responses
    for job_id, calls in ((JOB, [0, 1]), ("job-plain", [2])):
        labels = f'{{job_id="{job_id}"}}'
        prompt = sum(len(sent[i]["body"]["input_ids"]) for i in calls)
        completion = sum(len(answered[i]["output_ids"]) for i in calls)
        assert metric(metrics, f"miles_session_job_prompt_tokens_total{labels}") == prompt
        assert metric(metrics, f"miles_session_job_completion_tokens_total{labels}") == completion
