"""Staging a version in the engine before the pause, and the fallback for engines that cannot (stock SGLang).

An in-process HTTP engine stand-in (FastAPI on a real socket) records the calls of one delta-transport load: with
/stage_weights_from_tensor the payloads go out before the engine is quiesced and the pause only applies the stage;
without it (404) the same payloads go to /update_weights_from_tensor inside the pause, and the client remembers
not to ask again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Request

from miles.common.serve import serve_async
from miles.common.testing.ports import free_port
from miles.weightsync.engine_client import EngineClient
from miles.weightsync.manifest import TensorSpec
from miles.weightsync.transports import PreparedLoad, _TensorTransport
from miles.weightsync.weights import WeightSet, sha256_hex


def recording_engine(calls: list[tuple[str, dict[str, Any]]], *, staging: bool) -> FastAPI:
    app = FastAPI()

    async def record(request: Request) -> dict[str, Any]:
        calls.append((request.url.path, await request.json()))
        return {"success": True, "message": "ok"}

    paths = ["/update_weights_from_tensor"] + (["/stage_weights_from_tensor", "/apply_staged_weights"] * staging)
    for path in paths:
        app.add_api_route(path, record, methods=["POST"])
    return app


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    port, stop = free_port(), asyncio.Event()
    task = asyncio.create_task(
        serve_async(http_app=app, http_port=port, stop_event=stop, handle_signals=False, grace_s=1.0)
    )
    await asyncio.sleep(0.5)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await task


async def prepared_load(transport: _TensorTransport) -> PreparedLoad:
    data = {"a": bytes(range(64)), "b": bytes(128)}
    specs = tuple(TensorSpec(name, "bfloat16", (len(raw) // 2,), sha256_hex(raw)) for name, raw in data.items())
    return await transport._prepared(WeightSet(3, specs, data), specs, "delta", 0)


@pytest.mark.parametrize("staging", [True, False])
async def test_payloads_are_staged_before_the_pause_or_sent_within_it(staging: bool) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    transport = _TensorTransport(provider=None, batch_bytes=64)  # type: ignore[arg-type]
    async with serving(recording_engine(calls, staging=staging)) as url:
        engine = EngineClient(url, 30.0)
        prepared = await transport.stage(engine, await prepared_load(transport))
        before_pause = [path for path, _ in calls]
        result = await transport.apply(engine, prepared)
        await engine.close()
    assert result.bytes_to_engine == 192
    within_pause = [(path, body) for path, body in calls[len(before_pause) :]]
    if staging:
        assert before_pause == ["/stage_weights_from_tensor"] * 2 and prepared.stage_id.startswith("v3-")
        assert [path for path, _ in within_pause] == ["/apply_staged_weights"]
        assert within_pause[0][1]["stage_id"] == prepared.stage_id and within_pause[0][1]["weight_version"] == "3"
        assert engine.staging_supported is True
    else:
        assert before_pause == [] and prepared.stage_id == ""  # the 404 is not recorded
        assert [path for path, _ in within_pause] == ["/update_weights_from_tensor"] * 2
        assert [body["weight_version"] for _, body in within_pause] == [None, "3"]
        assert engine.staging_supported is False
