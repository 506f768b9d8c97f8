"""Token-guarded stand-ins for what weight-sync drives (imported by name: conftest.py puts this folder on sys.path):
an engine whose control endpoints need its admin API key (and whose /model_info needs its api key when it has
one, SGLang's rule) and a router whose admin API needs its admin token, the way the real ones guard them
(miles.common.auth: 401 without a token, 403 with another). Both record every call that got through, with the
token it carried, and serve in-process on a real socket (`serving`).

The engine takes tensor loads without decoding them (the bytes were checked by weight-sync before they left) and
reports the version it was last told; the router drains instantly. What they do not model: generation, staging
(/stage_weights_from_tensor answers 404, so loads go in the pause as with stock SGLang).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request

from miles.common.auth import AUTH_RESPONSES, BearerAuth, bearer_of
from miles.common.http import create_http_app
from miles.common.serve import serve_async
from miles.common.telemetry import Metrics


@dataclass
class Recorded:
    """The calls that passed the token check: (path, bearer token) in order."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def tokens(self) -> set[str]:
        return {token for _, token in self.calls}


def guarded_engine(admin_api_key: str, recorded: Recorded, *, api_key: str = "") -> FastAPI:
    """An SGLang-like engine whose control endpoints need `Authorization: Bearer <admin_api_key>` and whose info
    route (/model_info) needs `<api_key>` when one is set (else it is open)."""
    auth = BearerAuth([admin_api_key], what="the engine's control API")
    info_auth = BearerAuth([api_key], what="the engine API")
    app = create_http_app(service="fakeengine", metrics=Metrics("fakeengine"))
    control = APIRouter(dependencies=[Depends(auth.http_dependency)], responses=AUTH_RESPONSES)
    info = APIRouter(dependencies=[Depends(info_auth.http_dependency)], responses=AUTH_RESPONSES)
    state = {"weight_version": "default"}

    async def body_of(request: Request) -> dict[str, Any]:
        recorded.calls.append((request.url.path, bearer_of(request.headers.get("authorization"))))
        return await request.json() if await request.body() else {}

    @info.get("/model_info")
    async def model_info(request: Request) -> dict[str, Any]:
        await body_of(request)
        return {"weight_version": state["weight_version"], "model_path": "fake"}

    @control.post("/pause_generation")
    @control.post("/continue_generation")
    async def lifecycle(request: Request) -> dict[str, Any]:
        await body_of(request)
        return {"status": "ok"}

    @control.post("/update_weights_from_tensor")
    async def load(request: Request) -> dict[str, Any]:
        body = await body_of(request)
        if body.get("weight_version") is not None:
            state["weight_version"] = body["weight_version"]
        return {"success": True, "message": "ok"}

    @control.post("/update_weight_version")
    async def set_version(request: Request) -> dict[str, Any]:
        state["weight_version"] = (await body_of(request))["new_version"]
        return {"success": True}

    app.include_router(info)
    app.include_router(control)
    return app


def guarded_router(admin_token: str, engine_urls: list[str], recorded: Recorded) -> FastAPI:
    """A rollout router whose admin API (/admin/v1/*) needs `Authorization: Bearer <admin_token>`."""
    auth = BearerAuth([admin_token], what="the router's admin API")
    app = create_http_app(service="fakerouter", metrics=Metrics("fakerouter"))
    admin = APIRouter(prefix="/admin/v1", dependencies=[Depends(auth.http_dependency)], responses=AUTH_RESPONSES)

    def note(request: Request) -> None:
        recorded.calls.append((request.url.path, bearer_of(request.headers.get("authorization"))))

    @admin.post("/engines/drain")
    async def drain(request: Request) -> dict[str, Any]:
        note(request)
        return {"drained": True}

    @admin.post("/engines/undrain")
    async def undrain(request: Request) -> dict[str, Any]:
        note(request)
        return {}

    @admin.get("/engines")
    async def engines(request: Request) -> dict[str, Any]:
        note(request)
        return {"engines": [{"url": url} for url in engine_urls]}

    app.include_router(admin)
    return app


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """Serve `app` on a free loopback port of this event loop; yields its base URL."""
    stop, port = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_async(
            http_app=app,
            stop_event=stop,
            handle_signals=False,
            grace_s=1.0,
            on_started=lambda http_port, _: port.set_result(http_port),
        )
    )
    try:
        yield f"http://127.0.0.1:{await asyncio.wait_for(port, 30.0)}"
    finally:
        stop.set()
        await task
