"""Bearer tokens: the admin API (every /admin/v1/* route and every RouterAdminService method) needs admin_token,
the data plane and probes stay open, and the router sends engine_api_key to its engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from pydantic import ValidationError

from miles.common.auth import MIN_TOKEN_CHARS
from miles.common.grpc_client import create_channel
from miles.common.serve import serve_async
from miles.common.telemetry import Metrics
from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.proto.router.v1 import router_pb2, router_pb2_grpc
from miles.router.settings import RouterSettings

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "a" * MIN_TOKEN_CHARS
WRONG_TOKEN = "w" * MIN_TOKEN_CHARS
ENGINE_KEY = "k" * MIN_TOKEN_CHARS
ENGINE_ADMIN_KEY = "e" * MIN_TOKEN_CHARS
POOL = "job"


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def admin_routes(openapi: dict[str, Any]) -> list[tuple[str, str]]:
    """(method, path) of every admin HTTP route the app documents: a route added later is checked too."""
    return sorted(
        (method.upper(), path)
        for path, operations in openapi["paths"].items()
        if path.startswith("/admin/")
        for method in operations
    )


def example_request(method: str, path: str, engine_url: str) -> dict[str, Any]:
    """Arguments of a request that succeeds once the engine is registered in POOL (every route here takes the
    pool, and those with a body the engine url)."""
    if method == "GET":
        return {"params": {"pool": POOL}}
    return {"json": {"pool": POOL, "url": engine_url}}


async def test_every_admin_http_route_needs_the_admin_token(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(admin_token=ADMIN_TOKEN) as router:
        openapi = (await router.client.get("/openapi.json")).json()
        routes = admin_routes(openapi)
        assert len(routes) >= 6
        for method, path in routes:
            where = f"{method} {path}"
            request = example_request(method, path, engine.url)
            missing = await router.client.request(method, path, **request)
            wrong = await router.client.request(method, path, headers=bearer(WRONG_TOKEN), **request)
            assert (missing.status_code, missing.json()["error"]["code"]) == (401, "unauthenticated"), where
            assert (wrong.status_code, wrong.json()["error"]["code"]) == (403, "permission_denied"), where
            registered = await router.client.post(
                "/admin/v1/engines", json={"pool": POOL, "url": engine.url}, headers=bearer(ADMIN_TOKEN)
            )
            assert registered.status_code == 200
            right = await router.client.request(method, path, headers=bearer(ADMIN_TOKEN), **request)
            assert right.status_code == 200, f"{where}: {right.text}"
            assert {"401", "403"} <= set(openapi["paths"][path][method.lower()]["responses"]), where


async def test_data_plane_and_probes_stay_open(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(admin_token=ADMIN_TOKEN, engine_urls=[engine.url]) as router:
        for route in ("/generate", "/v1/completions"):
            answer = await router.client.post(route, content=json.dumps({"input_ids": [1, 2], "prompt": "x"}))
            assert answer.status_code == 200, route
        for probe in ("/healthz", "/readyz", "/metrics"):
            assert (await router.client.get(probe)).status_code == 200, probe
        generate = (await router.client.get("/openapi.json")).json()["paths"]["/generate"]["post"]
        assert "security" not in generate  # no router token; a 401 there is an engine's, passed through
        assert "passed through" in generate["responses"]["401"]["description"]


def admin_methods() -> list[str]:
    return [method.name for method in router_pb2.DESCRIPTOR.services_by_name["RouterAdminService"].methods]


def grpc_request(method_name: str, engine_url: str) -> Any:
    method = router_pb2.DESCRIPTOR.services_by_name["RouterAdminService"].methods_by_name[method_name]
    request_class = getattr(router_pb2, method.input_type.name)
    fields = {"pool": POOL, "url": engine_url}
    return request_class(**{name: value for name, value in fields.items() if name in method.input_type.fields_by_name})


async def call(channel: grpc.aio.Channel, method_name: str, request: Any) -> Any:
    return await getattr(router_pb2_grpc.RouterAdminServiceStub(channel), method_name)(request, timeout=10)


@pytest.mark.parametrize(
    ("token", "code"),
    [("", grpc.StatusCode.UNAUTHENTICATED), (WRONG_TOKEN, grpc.StatusCode.PERMISSION_DENIED)],
    ids=["no_token", "wrong_token"],
)
async def test_every_grpc_admin_method_refuses_a_missing_or_wrong_token(
    engines: Any, start_router: Any, token: str, code: grpc.StatusCode
) -> None:
    (engine,) = await engines(1)
    async with (
        start_router(admin_token=ADMIN_TOKEN) as router,
        create_channel(f"127.0.0.1:{router.grpc_port}", bearer_token=token) as channel,
    ):
        for method_name in admin_methods():
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, method_name, grpc_request(method_name, engine.url))
            assert refused.value.code() == code, method_name
        assert router.service.admin.list_engines(POOL) == []  # RegisterEngine was refused too


async def test_every_grpc_admin_method_accepts_the_admin_token(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with (
        start_router(admin_token=ADMIN_TOKEN) as router,
        create_channel(f"127.0.0.1:{router.grpc_port}", bearer_token=ADMIN_TOKEN) as channel,
    ):
        assert len(admin_methods()) >= 6
        for method_name in admin_methods():
            await call(channel, "RegisterEngine", grpc_request("RegisterEngine", engine.url))
            await call(channel, method_name, grpc_request(method_name, engine.url))


def test_settings_refuse_a_network_host_without_admin_token() -> None:
    with pytest.raises(ValidationError, match=r"admin_token is required when host is '0\.0\.0\.0'"):
        RouterSettings(host="0.0.0.0")
    with pytest.raises(ValidationError, match=f"at least {MIN_TOKEN_CHARS} characters"):
        RouterSettings(admin_token="short")
    assert RouterSettings(host="0.0.0.0", admin_token=ADMIN_TOKEN).admin_token.get_secret_value() == ADMIN_TOKEN
    assert "a" * 8 not in repr(RouterSettings(admin_token=ADMIN_TOKEN))  # never logged in clear


async def test_engine_api_key_goes_with_every_engine_request(engines: Any, start_router: Any, until: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_api_key=ENGINE_KEY, engine_urls=[engine.url]) as router:
        answer = await router.client.post(
            "/generate", content=json.dumps({"input_ids": [1, 2]}), headers=bearer("token-meant-for-the-router")
        )
        assert answer.status_code == 200
        await until(lambda: any(r.path == "/health" for r in engine.requests))
    paths = {request.path for request in engine.requests}
    assert {"/health", "/generate", "/server_info"} <= paths
    assert {request.headers.get("authorization") for request in engine.requests} == {f"Bearer {ENGINE_KEY}"}


async def test_without_engine_api_key_the_clients_authorization_goes_through(engines: Any, start_router: Any) -> None:
    (engine,) = await engines(1)
    async with start_router(engine_urls=[engine.url]) as router:
        await router.client.post("/generate", content=json.dumps({"input_ids": [1]}), headers=bearer("client-key"))
    assert [r.headers.get("authorization") for r in engine.generate_requests()] == ["Bearer client-key"]
    assert all("authorization" not in r.headers for r in engine.requests if r.path != "/generate")


@contextlib.asynccontextmanager
async def real_engine(model_dir: Path, **keys: str) -> AsyncIterator[str]:
    """A miles-engine (fake model: the real routes and key checks, no weights) in process; yields its URL."""
    from miles.engine.main import build_engine, create_app
    from miles.engine.settings import EngineSettings
    from miles.engine.tiny_model import TINY_QWEN3_CONFIG, qwen3_tokenizer_dir

    (model_dir / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    settings = EngineSettings(
        model_path=model_dir, tokenizer_path=qwen3_tokenizer_dir(), fake_model=True, weight_version="7", **keys
    )
    metrics = Metrics("engine")
    engine, served = build_engine(settings, metrics)
    stop = asyncio.Event()
    port: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_async(
            http_app=create_app(settings, engine, served, metrics),
            grace_s=1.0,
            on_started=lambda http_port, _: port.set_result(http_port),
            on_shutdown=[lambda: asyncio.to_thread(engine.scheduler.stop)],
            stop_event=stop,
            handle_signals=False,
        )
    )
    try:
        yield f"http://127.0.0.1:{await port}"
    finally:
        stop.set()
        await task


async def test_router_serves_from_an_engine_that_requires_its_key(tmp_path: Path, start_router: Any) -> None:
    """Router → miles-engine with SGLang's keys: the router's engine_api_key opens generation and the info routes
    its monitor reads; a router without it, or with another key, gets the engine's refusal passed through."""
    generate = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    async with real_engine(tmp_path, api_key=ENGINE_KEY, admin_api_key=ENGINE_ADMIN_KEY) as engine_url:
        async with start_router(engine_api_key=ENGINE_KEY, engine_urls=[engine_url]) as router:
            answer = await router.client.post("/generate", content=generate, headers=bearer(ADMIN_TOKEN))
            assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
            (engine,) = router.service.admin.list_engines()
            assert (engine.state.value, engine.weight_version) == ("healthy", 7)  # /health and /model_info read
        for engine_api_key, refusal in (("", 401), (WRONG_TOKEN, 403)):
            async with start_router(engine_api_key=engine_api_key, engine_urls=[engine_url]) as other:
                refused = await other.client.post("/generate", content=generate)
                assert refused.status_code == refusal, engine_api_key  # the engine's answer, passed through


async def test_the_router_process_takes_its_tokens_from_the_environment(engines: Any, tmp_path: Path) -> None:
    """miles-rollout-router as the controller starts it: MILES_ROUTER_ADMIN_TOKEN guards both admin transports,
    MILES_ROUTER_ENGINE_API_KEY goes to the engines."""
    (engine,) = await engines(1)
    port, grpc_port = free_port(), free_port()
    env = {
        "MILES_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN,
        "MILES_ROUTER_ENGINE_API_KEY": ENGINE_KEY,
        "MILES_ROUTER_ADMIN_GRPC_PORT": str(grpc_port),
        "MILES_ROUTER_ENGINE_URLS": json.dumps([engine.url]),
        "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "0.2",
    }
    url = f"http://127.0.0.1:{port}"
    router = ServiceProcess(
        [console_script("miles-rollout-router"), "--port", str(port)],
        ready_url=f"{url}/readyz",
        env=env,
        log_path=tmp_path / "router.log",
    )
    await asyncio.to_thread(router.start)  # the fake engine answers the router's probes on this loop meanwhile
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as client:
            assert (await client.get("/admin/v1/engines")).status_code == 401
            listed = await client.get("/admin/v1/engines", headers=bearer(ADMIN_TOKEN))
            assert [item["url"] for item in listed.json()["engines"]] == [engine.url]
            assert (await client.post("/generate", content=json.dumps({"input_ids": [1]}))).status_code == 200
        for token, code in (("", grpc.StatusCode.UNAUTHENTICATED), (ADMIN_TOKEN, grpc.StatusCode.OK)):
            async with create_channel(f"127.0.0.1:{grpc_port}", bearer_token=token) as channel:
                try:
                    await call(channel, "ListEngines", router_pb2.ListEnginesRequest())
                    answered = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    answered = exc.code()
            assert answered == code, token
    finally:
        await asyncio.to_thread(router.stop)
    assert {request.headers.get("authorization") for request in engine.requests} == {f"Bearer {ENGINE_KEY}"}


def test_the_router_process_refuses_a_network_host_without_admin_token() -> None:
    env = {**os.environ, "MILES_ROUTER_HOST": "0.0.0.0", "MILES_ROUTER_ADMIN_GRPC_PORT": "-1"}
    argv = [console_script("miles-rollout-router"), "--port", str(free_port())]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    assert "admin_token is required when host is '0.0.0.0'" in result.stderr
