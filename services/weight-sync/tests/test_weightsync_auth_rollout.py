"""The weight path with tokens configured everywhere: a trainer-like client publishes to a real origin daemon
(miles-weight-sync process, tokens from its environment), which rolls each version out through a real peer
daemon (its own store: versions replicate from the origin) into an engine behind a router, both of which refuse
calls without their tokens (weightsync_fake_control.py). It passes with the right tokens, and every wrong token
fails clearly: the publish with the gRPC status of the refusal, an engine update with an error naming the setting
to fix, the engine left out of service as after any failed update. Last, the real thing: a miles-engine process
with SGLang's two keys behind a miles-rollout-router process with its admin token."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from weightsync_fake_control import Recorded, guarded_engine, guarded_router, serving
from weightsync_testkit import start_daemon, start_engine, start_router, stop_all, wait_ready

from miles.common.auth import MIN_TOKEN_CHARS
from miles.common.errors import PermissionDeniedError, UnauthenticatedError
from miles.common.settings import load_settings
from miles.common.telemetry import Metrics
from miles.common.testing import free_port
from miles.weightsync.client import WeightSyncClient
from miles.weightsync.core import WeightSyncCore
from miles.weightsync.grpc_api import build_server
from miles.weightsync.settings import WeightsyncSettings

pytestmark = pytest.mark.integration
JOB = "job-auth-rollout"
TOKEN = "w" * MIN_TOKEN_CHARS
ENGINE_KEY = "e" * MIN_TOKEN_CHARS
ENGINE_API_KEY = "a" * MIN_TOKEN_CHARS
ROUTER_TOKEN = "r" * MIN_TOKEN_CHARS
WRONG = "x" * MIN_TOKEN_CHARS


def weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(128, 32, generator=generator),
        "norm.weight": torch.randn(32, generator=generator),
    }


@asynccontextmanager
async def engine_and_router(engine_api_key: str = "") -> AsyncIterator[tuple[str, str, Recorded, Recorded]]:
    """A guarded engine (admin key ENGINE_KEY, api key `engine_api_key`) and a guarded router listing it; yields
    their URLs and what each took."""
    engine_calls, router_calls = Recorded(), Recorded()
    async with (
        serving(guarded_engine(ENGINE_KEY, engine_calls, api_key=engine_api_key)) as engine_url,
        serving(guarded_router(ROUTER_TOKEN, [engine_url], router_calls)) as router_url,
    ):
        yield engine_url, router_url, engine_calls, router_calls


async def wait_for_engine_version(client: WeightSyncClient, version: int, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        status = await client.get_version(JOB)
        if status.engines and all(e.weight_version == version and not e.update_failed for e in status.engines):
            return status
        assert time.monotonic() < deadline, f"engines never reached version {version}: {status}"
        await asyncio.sleep(0.2)


async def test_publish_and_rollout_through_origin_and_peer_with_tokens_everywhere(tmp_path: Path) -> None:
    env = {
        "MILES_WEIGHTSYNC_AUTH_TOKEN": TOKEN,
        "MILES_WEIGHTSYNC_ROUTER_ADMIN_TOKEN": ROUTER_TOKEN,
        "MILES_WEIGHTSYNC_ENGINE_ADMIN_API_KEY": ENGINE_KEY,
    }
    async with engine_and_router() as (engine_url, router_url, engine_calls, router_calls):
        peer_port = free_port()
        common = {"job_id": JOB, "router_url": router_url, "pool": JOB, "pause_mode": "drain"}
        origin = start_daemon(
            {**common, "store_dir": str(tmp_path / "origin"), "peers": [f"127.0.0.1:{peer_port}"]},
            tmp_path,
            "origin",
            env=env,
        )
        peer_config = {**common, "store_dir": str(tmp_path / "peer"), "engine_urls": [engine_url]}
        peer = start_daemon({**peer_config, "origin": origin.address}, tmp_path, "peer", port=peer_port, env=env)
        try:
            await asyncio.to_thread(wait_ready, [origin, peer], "/readyz")
            async with WeightSyncClient(origin.address, auth_token=TOKEN) as trainer:
                for version in range(2):
                    await trainer.publish(JOB, version, version - 1, weights(version))
                    status = await wait_for_engine_version(trainer, version)
            for token, error in (("", UnauthenticatedError), (WRONG, PermissionDeniedError)):
                async with WeightSyncClient(origin.address, auth_token=token) as stranger:
                    with pytest.raises(error, match="weight-sync's WeightSyncService"):
                        await stranger.publish(JOB, 2, 1, weights(2))
            async with WeightSyncClient(origin.address, auth_token=TOKEN) as trainer:
                after = await trainer.get_version(JOB)
        finally:
            stop_all([peer, origin])
    assert [(e.engine_url, e.daemon) for e in status.engines] == [(engine_url, f"127.0.0.1:{peer_port}")]
    assert after.latest_version == 1  # the refused publishes stored nothing
    loads = [p for p in engine_calls.paths() if p in ("/update_weights_from_tensor", "/update_weight_version")]
    assert loads and "/pause_generation" in engine_calls.paths() and "/continue_generation" in engine_calls.paths()
    assert engine_calls.tokens() == {ENGINE_KEY}
    assert {"/admin/v1/engines/drain", "/admin/v1/engines/undrain"} <= set(router_calls.paths())
    assert router_calls.tokens() == {ROUTER_TOKEN}


@asynccontextmanager
async def daemon_driving(engine_url: str, router_url: str, **overrides: str) -> AsyncIterator[str]:
    """An in-process daemon (behind its real gRPC server, auth_token TOKEN) driving that engine behind that router,
    with the engine and router tokens (and other settings) in `overrides`; yields its address."""
    fields: dict[str, Any] = {
        "job_id": JOB,
        "store_url": f"memory://ws-auth-rollout-{uuid.uuid4().hex}",
        "auto_update": False,
        "reconcile_interval_s": 0,
        "engine_urls": [engine_url],
        "router_url": router_url,
        "pool": JOB,
        "pause_mode": "drain",
        "auth_token": TOKEN,
    }
    settings = load_settings(WeightsyncSettings, **{**fields, **overrides})
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


@pytest.mark.parametrize(
    ("tokens", "named"),
    [
        ({"router_admin_token": ROUTER_TOKEN, "engine_admin_api_key": WRONG}, "engine_admin_api_key"),
        ({"router_admin_token": ROUTER_TOKEN}, "engine_admin_api_key"),
        ({"router_admin_token": WRONG, "engine_admin_api_key": ENGINE_KEY}, "router_admin_token"),
    ],
    ids=["wrong_engine_key", "no_engine_key", "wrong_router_token"],
)
async def test_a_refused_engine_or_router_token_fails_the_update_naming_the_setting(
    tokens: dict[str, str], named: str
) -> None:
    async with (
        engine_and_router() as (engine_url, router_url, engine_calls, _),
        daemon_driving(engine_url, router_url, **tokens) as address,
        WeightSyncClient(address, auth_token=TOKEN) as trainer,
    ):
        await trainer.publish(JOB, 0, -1, weights(0))
        [outcome] = (await trainer.update_engines(JOB, 0, engine_timeout_s=30)).engines
    assert outcome.update_failed and named in outcome.error, outcome.error
    assert "/update_weight_version" not in engine_calls.paths()  # no version reached the engine


@pytest.mark.parametrize(
    ("engine_api_key", "named"),
    [(ENGINE_API_KEY, ""), ("", "engine_api_key"), (WRONG, "engine_api_key")],
    ids=["right_api_key", "no_api_key", "wrong_api_key"],
)
async def test_version_reads_carry_the_engines_api_key_when_they_have_one(engine_api_key: str, named: str) -> None:
    """An engine with an api key of its own opens /model_info (where the new version is read back) to that key
    alone; every other call of the update carries the admin key."""
    tokens = {"router_admin_token": ROUTER_TOKEN, "engine_admin_api_key": ENGINE_KEY, "engine_api_key": engine_api_key}
    async with (
        engine_and_router(engine_api_key=ENGINE_API_KEY) as (engine_url, router_url, engine_calls, _),
        daemon_driving(engine_url, router_url, **tokens) as address,
        WeightSyncClient(address, auth_token=TOKEN) as trainer,
    ):
        await trainer.publish(JOB, 0, -1, weights(0))
        [outcome] = (await trainer.update_engines(JOB, 0, engine_timeout_s=30)).engines
    if named:
        assert outcome.update_failed and named in outcome.error and "/model_info" in outcome.error, outcome.error
        return
    assert not outcome.update_failed and outcome.weight_version == 0, outcome.error
    assert {token for path, token in engine_calls.calls if path == "/model_info"} == {ENGINE_API_KEY}
    assert {token for path, token in engine_calls.calls if path != "/model_info"} == {ENGINE_KEY}


async def test_a_real_engine_and_router_with_every_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    """miles-engine with --api-key and --admin-api-key, behind miles-rollout-router with an admin token and the
    engines' api key: a daemon with the three tokens updates the engine, which then generates the new version
    through the router; without engine_api_key the update fails at the version read, naming the setting."""
    engine_flags = ("--fake-model", "--api-key", ENGINE_API_KEY, "--admin-api-key", ENGINE_KEY)
    engine = start_engine(tiny_model_dir, tmp_path, *engine_flags)
    router_env = {"MILES_ROUTER_ADMIN_TOKEN": ROUTER_TOKEN, "MILES_ROUTER_ENGINE_API_KEY": ENGINE_API_KEY}
    router = start_router([engine.url], tmp_path, env=router_env)
    tokens = {"router_admin_token": ROUTER_TOKEN, "engine_admin_api_key": ENGINE_KEY, "pool": "default"}
    try:
        await asyncio.to_thread(wait_ready, [engine, router], "/readyz")
        outcomes = []
        for version, engine_api_key in ((0, ENGINE_API_KEY), (1, "")):
            async with (
                daemon_driving(engine.url, router.url, engine_api_key=engine_api_key, **tokens) as address,
                WeightSyncClient(address, auth_token=TOKEN) as trainer,
            ):
                for published in range(version + 1):
                    await trainer.publish(JOB, published, published - 1, weights(published))
                [outcome] = (await trainer.update_engines(JOB, version, engine_timeout_s=60)).engines
                outcomes.append(outcome)
            if version == 0:
                async with httpx.AsyncClient(base_url=router.url, trust_env=False) as client:
                    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
                    generated = (await client.post("/generate", json=body)).json()
    finally:
        stop_all([router, engine])
    assert not outcomes[0].update_failed and outcomes[0].weight_version == 0, outcomes[0].error
    assert generated["meta_info"]["weight_version"] == "0"
    assert outcomes[1].update_failed and "engine_api_key" in outcomes[1].error, outcomes[1].error
