"""The data plane over real sockets: byte-exact passthrough, retries, failure injection, backpressure, errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def generate_body(tokens: list[int], **extra: Any) -> bytes:
    return json.dumps({"input_ids": tokens, "sampling_params": {"max_new_tokens": 4}, **extra}).encode()


async def test_generate_passthrough_is_byte_exact(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        body = (
            b'{"input_ids": [1, 2, 3],   "sampling_params": {"max_new_tokens": 4, "custom_params": {"a": 1}},'
            b' "return_routed_experts": true, "unknown_field": [null, 1.5e300]}'
        )
        response = await router.client.post("/generate", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 200
        assert engine.generate_requests()[-1].body == body  # nothing dropped or re-serialized on the way in
        assert response.content == engine.last_response_body  # nor on the way out
        assert response.headers["content-type"] == "application/json"
        assert json.loads(response.content)["extra"] == {"engine_only": [1, 2, {"x": None}]}
        stats = (await router.client.get("/admin/v1/stats")).json()
        assert stats["requests_total"] == 1 and stats["prompt_tokens_total"] == 3


async def test_stream_passthrough_is_byte_exact_and_counted(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        await router.client.post("/generate", content=generate_body([5, 6, 7, 8]))  # warm the engine's cache
        async with router.client.stream(
            "POST", "/generate", content=generate_body([5, 6, 7, 8, 1000, 1001, 1002, 9], stream=True)
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            chunks = [chunk async for chunk in response.aiter_bytes()]
        assert b"".join(chunks) == engine.last_response_body
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        stats = router.service.admin.stats("default")
        assert stats.prompt_tokens_total == 4 + 8
        assert stats.cached_tokens_total == 7  # prompt + output[:-1] of turn 1, read from the last SSE event


async def test_openai_routes_pass_through(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "session_id": "s"}
        response = await router.client.post("/v1/chat/completions", json=chat)
        assert response.status_code == 200 and response.content == engine.last_response_body
        response = await router.client.post("/v1/completions", json={"model": "m", "prompt": "hello world"})
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 11
        assert router.service.admin.stats().prompt_tokens_total == 5 + 11


async def test_sessions_stick_and_reuse_the_cache(engines: Any, start_router: Any) -> None:
    fleet = await engines(3)
    async with start_router(engine_urls=[e.url for e in fleet]) as router:
        served_by: dict[str, set[str]] = {}
        for turn in range(4):
            for session in range(6):
                key = f"session-{session}"
                tokens = [session * 10_000 + t for t in range(20 * (turn + 1))]
                response = await router.client.post(
                    "/generate", content=generate_body(tokens), headers={"X-SMG-Routing-Key": key}
                )
                assert response.status_code == 200
                served_by.setdefault(key, set()).add(response.json()["engine"])
        assert all(len(urls) == 1 for urls in served_by.values())
        assert len({url for urls in served_by.values() for url in urls}) == 3  # new sessions spread over engines
        stats = router.service.admin.stats()
        assert (stats.sticky_new_keys_total, stats.sticky_hits_total, stats.sticky_misses_total) == (6, 18, 0)
        assert stats.prefix_hit_rate > 0.4


async def test_dead_engine_loses_no_request_and_is_marked_unhealthy(engines: Any, start_router: Any) -> None:
    fleet = await engines(3)
    async with start_router(engine_urls=[e.url for e in fleet], health_check_interval_s=30.0) as router:
        for session in range(12):
            await router.client.post(
                "/generate", content=generate_body([session]), headers={"X-SMG-Routing-Key": f"s{session}"}
            )
        victim = fleet[0]
        on_victim = [f"s{i}" for i in range(12) if router.pool().policy.sticky_engine_url(f"s{i}") == victim.url]
        assert on_victim
        await victim.stop()
        for session in range(12):
            response = await router.client.post(
                "/generate", content=generate_body([session, 1]), headers={"X-SMG-Routing-Key": f"s{session}"}
            )
            assert response.status_code == 200
            assert response.json()["engine"] != victim.url
        stats = router.service.admin.stats()
        assert stats.sticky_misses_total == len(on_victim)
        assert stats.retries_total >= 1
        # Connection errors count as failed health probes: the engine is out after health_failure_threshold.
        for _ in range(3):
            await router.client.post(
                "/generate", content=generate_body([99]), headers={"X-SMG-Routing-Key": on_victim[0]}
            )
        engines_now = {e["url"]: e for e in (await router.client.get("/admin/v1/engines")).json()["engines"]}
        assert engines_now[victim.url]["state"] == "unhealthy"


async def test_health_checks_take_an_engine_out_and_back(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        pool = router.pool()
        engine.healthy = False
        await until(lambda: not pool.engines[engine.url].health.healthy)
        response = await router.client.post("/generate", content=generate_body([1]))
        assert response.status_code == 503
        assert "no available engine (1 unhealthy)" in response.json()["error"]["message"]
        engine.healthy = True
        await until(lambda: pool.engines[engine.url].health.healthy)
        assert (await router.client.post("/generate", content=generate_body([1]))).status_code == 200


async def test_5xx_is_retried_elsewhere(engines: Any, start_router: Any) -> None:
    broken, healthy = await engines(2)
    broken.mode = "error_503"
    async with start_router(engine_urls=[broken.url, healthy.url], policy="round_robin") as router:
        for i in range(6):
            response = await router.client.post("/generate", content=generate_body([i]))
            assert response.status_code == 200 and response.json()["engine"] == healthy.url
        # Every request tried the broken engine first until 5 failures opened its circuit breaker.
        assert router.service.admin.stats().retries_total == 5
        assert router.pool().engines[broken.url].circuit_open
        assert len(broken.generate_requests()) == 5


async def test_last_attempt_passes_the_engine_5xx_through(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1, mode="error_500")
    async with start_router(engine_urls=[engine.url], max_attempts=2) as router:
        response = await router.client.post("/generate", content=generate_body([1]))
        assert response.status_code == 500
        assert response.json() == {"object": "error", "message": "injected", "code": 500}
        assert len(engine.generate_requests()) == 2
        assert router.service.admin.stats().failures_total == 1


@pytest.mark.parametrize("mode", ["die_before_headers", "die_mid_body"])
async def test_engine_dying_before_the_answer_is_complete_is_retried(
    engines: Any, start_router: Any, mode: str
) -> None:
    dying, healthy = await engines(2)
    dying.mode = mode
    async with start_router(engine_urls=[dying.url, healthy.url], policy="round_robin") as router:
        for i in range(4):
            response = await router.client.post("/generate", content=generate_body([i]))
            assert response.status_code == 200 and response.json()["engine"] == healthy.url
        assert len(dying.generate_requests()) >= 1
        assert router.service.admin.stats().retries_total >= 1


async def test_stream_dying_before_its_first_event_is_retried(engines: Any, start_router: Any) -> None:
    dying, healthy = await engines(2, mode="stream_die", die_after_events=0)
    healthy.mode = "ok"
    async with start_router(engine_urls=[dying.url, healthy.url], policy="round_robin") as router:
        for i in range(2):
            response = await router.client.post("/generate", content=generate_body([i], stream=True))
            assert response.status_code == 200 and response.content == healthy.last_response_body


async def test_stream_dying_mid_way_ends_with_an_error_event(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1, mode="stream_die", die_after_events=2)
    async with start_router(engine_urls=[engine.url]) as router:
        response = await router.client.post("/generate", content=generate_body([1, 2], stream=True))
        assert response.status_code == 200
        events = [event for event in response.content.split(b"\n\n") if event]
        assert engine.last_response_body.startswith(b"\n\n".join(events[:2]))  # what was sent arrived unchanged
        error = json.loads(events[2].removeprefix(b"data: "))["error"]
        assert error["type"] == "engine_stream_broken" and error["retryable"] is True
        assert events[3] == b"data: [DONE]"
        assert len(engine.generate_requests()) == 1  # a started stream is never retried
        await until(lambda: router.pool().engines[engine.url].slots.is_idle())
        assert router.service.admin.stats().failures_total == 1


async def test_client_disconnect_mid_stream_releases_the_slot(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1, delay_s=0.2, num_output_tokens=50)
    async with start_router(engine_urls=[engine.url]) as router:
        async with router.client.stream("POST", "/generate", content=generate_body([1], stream=True)) as response:
            async for _ in response.aiter_bytes():
                break
        pool_engine = router.pool().engines[engine.url]
        await until(lambda: pool_engine.slots.is_idle())
        assert not pool_engine.circuit_open and pool_engine.breaker.consecutive_failures == 0


async def test_backpressure_answers_429_with_retry_after(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1, delay_s=0.5)
    settings = {"engine_max_concurrency": 1, "engine_max_queue": 0, "backpressure_retry_after_s": 2.0}
    async with start_router(engine_urls=[engine.url], **settings) as router:
        first = asyncio.create_task(router.client.post("/generate", content=generate_body([1])))
        await until(lambda: engine.num_in_flight == 1)
        refused = await router.client.post("/generate", content=generate_body([2]))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "backpressure"
        assert (await first).status_code == 200
        assert router.service.admin.stats().backpressure_total == 1


async def test_queue_keeps_the_engine_at_its_concurrency_limit(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1, delay_s=0.05, max_running_requests=2)
    async with start_router(engine_urls=[engine.url]) as router:
        snapshot = router.service.admin.list_engines()[0]
        assert snapshot.max_concurrency == 2  # read from the engine's server_info
        responses = await asyncio.gather(
            *(router.client.post("/generate", content=generate_body([i])) for i in range(8))
        )
        assert all(response.status_code == 200 for response in responses)
        assert engine.max_in_flight_seen == 2


async def test_malformed_json_gets_the_engines_400_unchanged(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        response = await router.client.post(
            "/generate", content=b'{"input_ids": [1, 2', headers={"X-SMG-Routing-Key": "k"}
        )
        assert response.status_code == 400
        assert response.content.startswith(b'{"error": {"message": "malformed JSON')
        assert engine.generate_requests()[-1].body == b'{"input_ids": [1, 2'


async def test_router_errors_are_clear(engines: Any, start_router: Any) -> None:
    async with start_router() as router:
        assert (await router.client.post("/nope", json={})).status_code == 404
        assert (await router.client.get("/generate")).status_code == 405
        empty = await router.client.post("/generate", content=generate_body([1]))
        assert empty.status_code == 503
        assert empty.json()["error"]["message"] == "pool 'default' has no engines registered"
        unknown = await router.client.post("/generate", content=generate_body([1]), headers={"X-Miles-Pool": "job-x"})
        assert unknown.status_code == 503 and "no engine pool named 'job-x'" in unknown.json()["error"]["message"]
        bad = await router.client.post("/generate", content=b"{}", headers={"X-Miles-Min-Weight-Version": "new"})
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "X-Miles-Min-Weight-Version"


async def test_min_weight_version_is_409_until_an_engine_is_updated(
    engines: Any, start_router: Any, until: Any
) -> None:
    fleet = await engines(2, weight_version=1)
    async with start_router(engine_urls=[e.url for e in fleet]) as router:
        headers = {"X-Miles-Min-Weight-Version": "2", "X-SMG-Routing-Key": "s"}
        refused = await router.client.post("/generate", content=generate_body([1]), headers=headers)
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["code"] == "weight_version_too_old" and "newest: 1" in error["message"]
        assert refused.headers["retry-after"] == "1"
        fleet[1].weight_version = 2
        await until(lambda: router.pool().engines[fleet[1].url].weight_version == 2)  # polled from /model_info
        for _ in range(3):
            served = await router.client.post("/generate", content=generate_body([1]), headers=headers)
            assert served.status_code == 200 and served.json()["engine"] == fleet[1].url
        body_gated = await router.client.post("/generate", content=generate_body([1], min_weight_version=3))
        assert body_gated.status_code == 409
        assert router.service.admin.stats().version_conflicts_total == 2


async def test_engine_409_for_a_stale_version_is_retried_on_another(engines: Any, start_router: Any) -> None:
    behind, current = await engines(2, weight_version=3)
    async with start_router(engine_urls=[behind.url, current.url], policy="round_robin") as router:
        behind.weight_version = 2  # the router has not polled yet: it still believes 3
        for i in range(2):
            response = await router.client.post("/generate", content=generate_body([i], min_weight_version=3))
            assert response.status_code == 200 and response.json()["engine"] == current.url


async def test_metrics_are_exposed(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        await router.client.post("/generate", content=generate_body([1, 2]), headers={"X-SMG-Routing-Key": "k"})
        await router.client.post("/generate", content=generate_body([1, 2, 3]), headers={"X-SMG-Routing-Key": "k"})
        text = (await router.client.get("/metrics")).text
        for line in (
            'miles_router_requests_total{policy="session_affinity",pool="default",route="/generate"} 2.0',
            'miles_router_sticky_hits_total{policy="session_affinity",pool="default"} 1.0',
            'miles_router_sticky_new_keys_total{policy="session_affinity",pool="default"} 1.0',
            'miles_router_prompt_tokens_total{policy="session_affinity",pool="default"} 5.0',
            f'miles_router_engine_in_flight_requests{{engine="{engine.url}",pool="default"}} 0.0',
            f'miles_router_engine_queue_depth_requests{{engine="{engine.url}",pool="default"}} 0.0',
            f'miles_router_engine_healthy{{engine="{engine.url}",pool="default"}} 1.0',
            'miles_router_prefix_hit_ratio{policy="session_affinity",pool="default"}',
        ):
            assert line in text, line
