"""Bearer tokens around the trainer: its control API (a real miles-trainer process) needs `auth_token`; it sends
`weightsync_auth_token` to a token-guarded weight-sync origin (real gRPC server, in-process core) and
`engine_admin_api_key` / `router_admin_token` to engines and a router that refuse calls without them (in-process
stand-ins on real sockets); a refused token fails at once and says so; settings refuse an exposed trainer without
a token."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from fastapi import APIRouter, Depends, FastAPI, Request

from miles.common.auth import AUTH_RESPONSES, MIN_TOKEN_CHARS, BearerAuth, bearer_metadata, bearer_of
from miles.common.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from miles.common.http import create_http_app
from miles.common.serve import serve_async
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.common.testing.smoke import console_script
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from miles.trainer.publish import make_publisher
from miles.trainer.settings import PublishSettings, TrainerSettings

TOKEN = "t" * MIN_TOKEN_CHARS
WRONG = "x" * MIN_TOKEN_CHARS
ENGINE_KEY = "e" * MIN_TOKEN_CHARS
ENGINE_API_KEY = "a" * MIN_TOKEN_CHARS
ROUTER_TOKEN = "r" * MIN_TOKEN_CHARS
REQUESTS: dict[str, Any] = {
    "Status": trainer_pb2.StatusRequest(),
    "Checkpoint": trainer_pb2.CheckpointRequest(),
    "Stop": trainer_pb2.StopRequest(),
    "WatchEvents": trainer_pb2.WatchEventsRequest(),
}


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 8, generator=generator), "model.norm.weight": torch.ones(8)}


def control_call(port: int, method: str, token: str) -> grpc.StatusCode:
    """One call of the trainer's `method` carrying `token` ("" = none); the status it ended with."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        rpc = getattr(trainer_pb2_grpc.TrainerServiceStub(channel), method)  # type: ignore[no-untyped-call]
        try:
            answer = rpc(REQUESTS[method], timeout=2.0, metadata=bearer_metadata(token))
            if method == "WatchEvents":
                next(answer)  # an idle trainer has no events: DEADLINE_EXCEEDED once it got through
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.mark.integration
def test_every_control_method_needs_the_token(start_trainer: Callable[[dict[str, str]], Any]) -> None:
    assert set(REQUESTS) == set(trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].methods_by_name)
    trainer = start_trainer({"MILES_TRAINER_AUTH_TOKEN": TOKEN})  # no job: the API is served idle
    trainer.auth_token = TOKEN
    trainer.start()
    for method in REQUESTS:
        assert control_call(trainer.port, method, "") == grpc.StatusCode.UNAUTHENTICATED, method
        assert control_call(trainer.port, method, WRONG) == grpc.StatusCode.PERMISSION_DENIED, method
    assert control_call(trainer.port, "Checkpoint", TOKEN) == grpc.StatusCode.FAILED_PRECONDITION  # no job
    assert control_call(trainer.port, "WatchEvents", TOKEN) == grpc.StatusCode.DEADLINE_EXCEEDED  # no events
    assert trainer.status().state == trainer_pb2.TRAINER_STATE_STOPPED


@pytest.mark.integration
def test_an_exposed_trainer_process_without_a_token_refuses_to_start() -> None:
    env = {**os.environ, "MILES_TRAINER_HOST": "0.0.0.0", "MILES_TRAINER_PORT": str(free_port())}
    env.pop("MILES_TRAINER_AUTH_TOKEN", None)
    result = subprocess.run(
        [console_script("miles-trainer")], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode != 0
    assert "auth_token is required when host is '0.0.0.0'" in result.stderr


def test_settings_refuse_an_exposed_trainer_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"auth_token is required when host is '0\.0\.0\.0'"):
        load_settings(TrainerSettings, host="0.0.0.0")
    with pytest.raises(ConfigError, match=f"at least {MIN_TOKEN_CHARS}"):
        load_settings(TrainerSettings, auth_token="short")
    names = {
        "AUTH_TOKEN": "auth_token",
        "WEIGHTSYNC_AUTH_TOKEN": "weightsync_auth_token",
        "ENGINE_ADMIN_API_KEY": "engine_admin_api_key",
        "ENGINE_API_KEY": "engine_api_key",
        "ROUTER_ADMIN_TOKEN": "router_admin_token",
    }
    monkeypatch.setenv("MILES_TRAINER_HOST", "0.0.0.0")
    for env_suffix, field in names.items():
        monkeypatch.setenv(f"MILES_TRAINER_{env_suffix}", f"{field}-{TOKEN}")
    settings = load_settings(TrainerSettings)
    assert {field: getattr(settings, field).get_secret_value() for field in names.values()} == {
        field: f"{field}-{TOKEN}" for field in names.values()
    }
    assert TOKEN not in repr(settings)


@contextlib.asynccontextmanager
async def guarded_origin() -> AsyncIterator[str]:
    """A weight-sync origin whose API needs TOKEN (its own server builder, memory:// store)."""
    from miles.weightsync.core import WeightSyncCore
    from miles.weightsync.grpc_api import build_server
    from miles.weightsync.settings import WeightsyncSettings

    store_url = f"memory://trainer-auth-{uuid.uuid4().hex}"
    settings = load_settings(WeightsyncSettings, job_id="job-t", store_url=store_url, auth_token=TOKEN)
    metrics = Metrics("weightsync")
    core = WeightSyncCore(settings, metrics)
    await core.start()
    server = build_server(core, metrics, port=0)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)
        await core.close()


def stream_settings(tmp_path: Path, address: str, token: str) -> TrainerSettings:
    publish = PublishSettings(weightsync_address=address, retry_timeout_s=30)
    return TrainerSettings(
        job_id="job-t",
        model_path=tmp_path,
        checkpoint_dir=tmp_path / "ckpt",
        publish=publish,
        weightsync_auth_token=token,
    )


async def test_stream_publishing_to_a_guarded_origin_needs_its_token(tmp_path: Path) -> None:
    from miles.weightsync.client import WeightSyncClient

    async with guarded_origin() as address:
        publisher = make_publisher(stream_settings(tmp_path / "right", address, TOKEN))
        assert (await publisher.resume(0, weights(0), step=0)).version == 0
        assert (await publisher.publish(1, weights(1), step=1, step_finished_unix_ms=1)).version == 1
        await publisher.close()
        for token, error in (("", UnauthenticatedError), (WRONG, PermissionDeniedError)):
            refused = make_publisher(stream_settings(tmp_path / f"refused-{len(token)}", address, token))
            started_s = time.monotonic()
            with pytest.raises(error, match="weight-sync's WeightSyncService"):
                await refused.publish(2, weights(2), step=2, step_finished_unix_ms=1)
            assert time.monotonic() - started_s < 10 and refused.take_failures() == 0  # not retried
            await refused.close()
        async with WeightSyncClient(address, auth_token=TOKEN) as client:
            assert (await client.get_version("job-t")).latest_version == 1


def guarded_engine_and_router(calls: list[tuple[str, str]]) -> tuple[FastAPI, Callable[[str], FastAPI]]:
    """An engine with SGLang's two keys (control routes need ENGINE_KEY, the info route /model_info ENGINE_API_KEY)
    and (given the engine's URL) a router whose admin API needs ROUTER_TOKEN and lists that engine in every pool;
    both record (path, token) of the calls they let through."""
    engine = create_http_app(service="fakeengine", metrics=Metrics("fakeengine"))
    control = APIRouter(
        dependencies=[Depends(BearerAuth([ENGINE_KEY], what="the engine's control API").http_dependency)],
        responses=AUTH_RESPONSES,
    )
    info = APIRouter(
        dependencies=[Depends(BearerAuth([ENGINE_API_KEY], what="the engine API").http_dependency)],
        responses=AUTH_RESPONSES,
    )
    state = {"weight_version": "default"}

    async def note(request: Request) -> dict[str, Any]:
        calls.append((request.url.path, bearer_of(request.headers.get("authorization"))))
        return await request.json() if await request.body() else {}

    @info.get("/model_info")
    async def model_info(request: Request) -> dict[str, Any]:
        await note(request)
        return {"weight_version": state["weight_version"]}

    @control.post("/pause_generation")
    @control.post("/continue_generation")
    @control.post("/update_weights_from_disk")
    @control.post("/update_weight_version")
    async def control_route(request: Request) -> dict[str, Any]:
        body = await note(request)
        state["weight_version"] = body.get("new_version", body.get("weight_version", state["weight_version"]))
        return {"success": True}

    engine.include_router(info)
    engine.include_router(control)

    def router_for(engine_url: str) -> FastAPI:
        router = create_http_app(service="fakerouter", metrics=Metrics("fakerouter"))
        auth = BearerAuth([ROUTER_TOKEN], what="the router's admin API")
        admin = APIRouter(prefix="/admin/v1", dependencies=[Depends(auth.http_dependency)], responses=AUTH_RESPONSES)

        @admin.get("/engines")
        @admin.post("/engines/drain")
        @admin.post("/engines/undrain")
        async def admin_route(request: Request) -> dict[str, Any]:
            await note(request)
            return {"engines": [{"url": engine_url}], "drained": True}

        router.include_router(admin)
        return router

    return engine, router_for


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    stop, port = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_async(
            http_app=app, stop_event=stop, handle_signals=False, grace_s=1.0, on_started=lambda p, _: port.set_result(p)
        )
    )
    try:
        yield f"http://127.0.0.1:{await asyncio.wait_for(port, 30.0)}"
    finally:
        stop.set()
        await task


@pytest.mark.parametrize(
    ("engine_key", "engine_api_key", "failures"),
    [(ENGINE_KEY, ENGINE_API_KEY, 0), (WRONG, ENGINE_API_KEY, 1), (ENGINE_KEY, "", 1)],
    ids=["right_tokens", "wrong_engine_key", "no_engine_api_key"],
)
async def test_disk_publisher_sends_the_engine_keys_and_router_token(
    tmp_path: Path, engine_key: str, engine_api_key: str, failures: int
) -> None:
    calls: list[tuple[str, str]] = []
    engine_app, router_for = guarded_engine_and_router(calls)
    async with serving(engine_app) as engine_url, serving(router_for(engine_url)) as router_url:
        publish = PublishSettings(kind="disk", dtype="float32", router_url=router_url, engine_timeout_s=30)
        settings = TrainerSettings(
            job_id="job-t",
            model_path=tmp_path,
            checkpoint_dir=tmp_path / "ckpt",
            publish=publish,
            engine_admin_api_key=engine_key,
            engine_api_key=engine_api_key,
            router_admin_token=ROUTER_TOKEN,
        )
        publisher = make_publisher(settings)
        record = await publisher.resume(0, weights(0), step=0)
        await publisher.close()
    assert record.version == 0 and publisher.take_failures() == failures
    paths = [path for path, _ in calls]
    assert {"/admin/v1/engines", "/admin/v1/engines/drain"} <= set(paths)
    assert ("/update_weights_from_disk" in paths) == (engine_key == ENGINE_KEY)  # a refused pause stops the update
    assert ("/model_info" in paths) == (failures == 0)  # the version read back, with the api key only
    assert {token for path, token in calls if path == "/model_info"} <= {ENGINE_API_KEY}
    control = {token for path, token in calls if path != "/model_info" and not path.startswith("/admin/")}
    assert control <= {ENGINE_KEY}
    assert {token for path, token in calls if path.startswith("/admin/")} == {ROUTER_TOKEN}
