"""The admin API over real sockets: HTTP mirror and gRPC RouterAdminService, pools, drain, run-time registration."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest

from miles.proto.router.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration


def generate_body(tokens: list[int], **extra: Any) -> bytes:
    return json.dumps({"input_ids": tokens, **extra}).encode()


async def test_pools_are_isolated_over_http(engines: Any, start_router: Any) -> None:
    engine_a, engine_b = await engines(2)
    async with start_router() as router:
        for pool, engine in (("job-a", engine_a), ("job-b", engine_b)):
            registered = await router.client.post("/admin/v1/engines", json={"pool": pool, "url": engine.url + "/"})
            assert registered.status_code == 200
            assert (
                registered.json()["engine"] | {"pool": pool, "url": engine.url, "state": "healthy"}
                == registered.json()["engine"]
            )
        for i in range(10):
            for pool, engine in (("job-a", engine_a), ("job-b", engine_b)):
                response = await router.client.post(
                    "/generate",
                    content=generate_body([i]),
                    headers={"X-Miles-Pool": pool, "X-SMG-Routing-Key": f"s{i}"},
                )
                assert response.json()["engine"] == engine.url
        await engine_b.stop()
        response = await router.client.post("/generate", content=generate_body([1]), headers={"X-Miles-Pool": "job-b"})
        assert response.status_code == 503  # job-b never borrows job-a's healthy engine
        assert len(engine_a.generate_requests()) == 10
        listed = (await router.client.get("/admin/v1/engines", params={"pool": "job-a"})).json()["engines"]
        assert [engine["url"] for engine in listed] == [engine_a.url]
        assert len((await router.client.get("/admin/v1/engines")).json()["engines"]) == 2
        stats = (await router.client.get("/admin/v1/stats", params={"pool": "job-a"})).json()
        assert stats["requests_total"] == 10 and stats["policy"] == "session_affinity"


async def test_runtime_registered_engine_receives_new_sessions(engines: Any, start_router: Any, until: Any) -> None:
    first, late = await engines(2, delay_s=0.2)
    async with start_router(engine_urls=[first.url]) as router:
        busy = [
            asyncio.create_task(
                router.client.post("/generate", content=generate_body([i]), headers={"X-SMG-Routing-Key": f"old{i}"})
            )
            for i in range(3)
        ]
        await until(lambda: first.num_in_flight == 3)
        registered = await router.client.post("/admin/v1/engines", json={"url": late.url, "max_concurrency": 8})
        assert registered.json()["engine"]["max_concurrency"] == 8
        new = await router.client.post("/generate", content=generate_body([9]), headers={"X-SMG-Routing-Key": "new"})
        assert new.json()["engine"] == late.url  # least-loaded placement of a new key
        await asyncio.gather(*busy)
        old = await router.client.post("/generate", content=generate_body([1]), headers={"X-SMG-Routing-Key": "old0"})
        assert old.json()["engine"] == first.url  # existing sessions keep their cache


async def test_drain_waits_for_in_flight_then_undrain(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1, delay_s=0.3)
    async with start_router(engine_urls=[engine.url]) as router:
        in_flight = asyncio.create_task(router.client.post("/generate", content=generate_body([1])))
        await until(lambda: engine.num_in_flight == 1)
        drained = await router.client.post(
            "/admin/v1/engines/drain", json={"url": engine.url, "wait": True, "timeout_s": 30}
        )
        assert drained.json()["drained"] is True and drained.json()["engine"]["state"] == "drained"
        assert in_flight.done() and (await in_flight).status_code == 200  # it finished before drain returned
        held = asyncio.create_task(router.client.post("/generate", content=generate_body([2])))
        engine.weight_version = 7  # updated while drained; undrain re-reads the version
        engine.healthy = False  # and failed health probes while loading (SGLang's /health blocks behind loads)
        pool_engine = router.pool().engines[engine.url]
        await until(lambda: not pool_engine.health.healthy)
        await asyncio.sleep(0.3)
        assert not held.done()  # the lone engine is drained for an update: the request waits, no 503
        engine.healthy = True
        undrained = await router.client.post("/admin/v1/engines/undrain", json={"url": engine.url})
        assert undrained.json()["engine"]["state"] == "healthy"
        assert undrained.json()["engine"]["weight_version"] == 7
        assert (await held).status_code == 200  # served by the updated engine
        served = await router.client.post("/generate", content=generate_body([3], min_weight_version=7))
        assert served.status_code == 200


async def test_without_a_hold_a_drained_lone_engine_is_503_at_once(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url], transient_hold_s=0.0) as router:
        await router.client.post("/admin/v1/engines/drain", json={"url": engine.url, "wait": True, "timeout_s": 30})
        refused = await router.client.post("/generate", content=generate_body([2]))
        assert refused.status_code == 503 and "1 drained" in refused.json()["error"]["message"]


async def test_drain_without_wait_and_timeout(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1, delay_s=1.0)
    async with start_router(engine_urls=[engine.url]) as router:
        in_flight = asyncio.create_task(router.client.post("/generate", content=generate_body([1])))
        await until(lambda: engine.num_in_flight == 1)
        result = await router.service.admin.drain_engine("", engine.url, wait=False, timeout_s=0)
        assert result.drained is False and result.engine.state.value == "draining"
        timed_out = await router.service.admin.drain_engine("", engine.url, wait=True, timeout_s=0.01)
        assert timed_out.drained is False
        await in_flight
        assert (await router.service.admin.drain_engine("", engine.url, wait=True, timeout_s=5)).drained


async def test_an_engine_found_paused_is_served_again_at_undrain(engines: Any, start_router: Any) -> None:
    """Registered while paused (e.g. mid-update when this router started): no requests; weight-sync's undrain after
    its resume checks it at once, without waiting for the monitor (whose intervals here are too long to help)."""
    (engine,) = await engines(1, generating=False)
    async with start_router(health_check_interval_s=60.0, serving_check_interval_s=60.0) as router:
        registered = await router.client.post("/admin/v1/engines", json={"url": engine.url})
        assert registered.json()["engine"]["state"] == "unhealthy" and router.pool().engines[engine.url].paused
        refused = await router.client.post("/generate", content=generate_body([1]))
        assert refused.status_code == 503 and "(1 paused)" in refused.json()["error"]["message"]
        await router.client.post("/admin/v1/engines/drain", json={"url": engine.url})
        engine.generating = True  # resumed by the update
        undrained = await router.client.post("/admin/v1/engines/undrain", json={"url": engine.url})
        assert undrained.json()["engine"]["state"] == "healthy"
        assert (await router.client.post("/generate", content=generate_body([2]))).status_code == 200
    assert len(engine.generate_requests()) == 1


async def test_an_engine_without_a_generation_check_route_is_never_paused(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)  # /health_generate answers 404
    async with start_router(engine_urls=[engine.url], serving_check_interval_s=0.05) as router:
        assert (await router.client.post("/generate", content=generate_body([1]))).status_code == 200
        await asyncio.sleep(0.3)
        pool_engine = router.pool().engines[engine.url]
        assert not pool_engine.paused and not pool_engine.serving_check_supported
    assert [r.path for r in engine.requests].count("/health_generate") == 1  # asked once, at registration


async def test_admin_errors(start_router: Any) -> None:
    async with start_router() as router:
        missing = await router.client.post("/admin/v1/engines/drain", json={"pool": "nope", "url": "http://x:1"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "engine_not_found"
        # Not http(s), no host, an unclosed IPv6 bracket, a host no HTTP client takes, a lone surrogate, a query.
        for url in ("ftp://x", "http://", "http://<]", "http://\u00b2", "http://x/\udc01", "http://x/?a=1"):
            body = json.dumps({"url": url})  # ASCII JSON: a lone surrogate travels as an escape
            for path in ("/admin/v1/engines", "/admin/v1/engines/drain"):
                answer = await router.client.post(path, content=body, headers={"content-type": "application/json"})
                assert answer.status_code == 400 and answer.json()["error"]["field"] == "url", (path, url)
        assert (await router.client.post("/admin/v1/engines", json={"pool": "p"})).status_code == 422


async def test_grpc_admin_service(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1, weight_version=3)
    async with start_router() as router, grpc.aio.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = router_pb2_grpc.RouterAdminServiceStub(channel)
        registered = await stub.RegisterEngine(router_pb2.RegisterEngineRequest(pool="job", url=engine.url))
        assert registered.engine.state == router_pb2.ENGINE_STATE_HEALTHY
        assert registered.engine.weight_version == 3
        assert registered.engine.source == router_pb2.ENGINE_SOURCE_ADMIN
        response = await router.client.post("/generate", content=generate_body([1, 2]), headers={"X-Miles-Pool": "job"})
        assert response.status_code == 200
        drained = await stub.DrainEngine(router_pb2.DrainEngineRequest(pool="job", url=engine.url, wait=True))
        assert drained.drained and drained.engine.state == router_pb2.ENGINE_STATE_DRAINED
        undrained = await stub.UndrainEngine(router_pb2.UndrainEngineRequest(pool="job", url=engine.url))
        assert undrained.engine.state == router_pb2.ENGINE_STATE_HEALTHY
        listed = await stub.ListEngines(router_pb2.ListEnginesRequest(pool="job"))
        assert [e.url for e in listed.engines] == [engine.url]
        stats = await stub.Stats(router_pb2.StatsRequest(pool="job"))
        assert (stats.requests_total, stats.prompt_tokens_total, stats.num_engines) == (1, 2, 1)
        removed = await stub.DeregisterEngine(router_pb2.DeregisterEngineRequest(pool="job", url=engine.url))
        assert removed.removed
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.DrainEngine(router_pb2.DrainEngineRequest(pool="job", url=engine.url))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_weight_version_answers_the_lowest_version_an_available_engine_serves(
    engines: Any, start_router: Any
) -> None:
    old, new = await engines(2)
    old.weight_version, new.weight_version = 3, 4
    async with start_router() as router:
        empty = (await router.client.get("/v1/weight_version", params={"pool": "job-a"})).json()
        assert empty == {
            "pool": "job-a",
            "min_weight_version": None,
            "max_weight_version": None,
            "num_available_engines": 0,
        }
        for engine in (old, new):
            await router.client.post("/admin/v1/engines", json={"pool": "job-a", "url": engine.url})
        both = (await router.client.get("/v1/weight_version", params={"pool": "job-a"})).json()
        assert (both["min_weight_version"], both["max_weight_version"], both["num_available_engines"]) == (3, 4, 2)
        # A drained engine (being updated) takes no requests: what it serves does not hold anyone back.
        await router.client.post("/admin/v1/engines/drain", json={"pool": "job-a", "url": old.url})
        drained = (await router.client.get("/v1/weight_version", params={"pool": "job-a"})).json()
        assert (drained["min_weight_version"], drained["num_available_engines"]) == (4, 1)
        other = (await router.client.get("/v1/weight_version", params={"pool": "job-b"})).json()
        assert other["num_available_engines"] == 0
