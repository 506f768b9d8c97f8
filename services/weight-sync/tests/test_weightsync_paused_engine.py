"""An engine whose requests cannot finish must not stall a weight update: real processes (one miles-engine with the
tiny model, a miles-rollout-router, the weight-sync daemon), the router restarted with kill -9.

The fault measured on main: an update failed while the router was down and left the engine paused; a router
started afterwards sent it requests, which a paused engine holds; the next update drained the engine at the
router and waited engine_timeout_s (600 s) for requests that could not finish. Here the router runs without its
generation check (`serving_check_path` ""), so that requests do reach the paused engine, as they did then (and as
they can whenever a request was routed just before a pause; the router's check has its own tests). The daemon must
not wait for them when it left the engine paused itself, and never longer than `drain_timeout_s` otherwise; the
per-engine timeout stays at its 600 s default, and the hang guard of each update is far below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from weightsync_testkit import (
    Proc,
    TinyTrainer,
    start_daemon,
    start_engine,
    stop_all,
    wait_ready,
)

from miles.common.testing import ServiceProcess, free_port
from miles.common.testing.smoke import console_script
from miles.weightsync.client import WeightSyncClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = "job-paused"
DRAIN_TIMEOUT_S = 2.0
UPDATE_HANG_GUARD_S = 180.0  # far below engine_timeout_s (600): an update that waits for held requests fails here
NUM_HELD_REQUESTS = 3


@dataclass
class Cluster:
    engine: Proc
    router: Proc
    daemon: Proc
    trainer: TinyTrainer
    published: list[int] = field(default_factory=list)


def _start_router(engine_url: str, log_dir: Path) -> Proc:
    port = free_port()
    env = {
        "MILES_ROUTER_PORT": str(port),
        "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
        "MILES_ROUTER_ENGINE_URLS": json.dumps([engine_url]),
        "MILES_ROUTER_SERVING_CHECK_PATH": "",  # see the module docstring
        "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "0.5",
        "MILES_ROUTER_VERSION_POLL_INTERVAL_S": "0.5",
        "MILES_ROUTER_LOG_JSON": "false",
    }
    process = ServiceProcess(
        [console_script("miles-rollout-router")], ready_url=None, log_path=log_dir / "router.log", env=env
    ).start()
    return Proc(process, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("ws-paused")
    logs = root / "logs"
    logs.mkdir()
    engine = start_engine(tiny_model_dir, logs)
    router = _start_router(engine.url, logs)
    procs = [engine, router]
    try:
        daemon = start_daemon(
            {
                "job_id": JOB,
                "router_url": router.url,
                "engine_urls": [engine.url],
                "store_dir": str(root / "store"),
                "work_dir": str(root / "work"),
                "model_config_dir": str(tiny_model_dir),
                "auto_update": False,
                "drain_timeout_s": DRAIN_TIMEOUT_S,
                "control_timeout_s": 5,
                "shutdown_grace_s": 1,
            },
            logs,
            "origin",
        )
        procs.append(daemon)
        wait_ready([engine], "/readyz")
        wait_ready([router, daemon], "/readyz")
        asyncio.run(_wait_router_engine(router.url, lambda e: e["state"] == "healthy"))
        yield Cluster(engine, router, daemon, TinyTrainer(tiny_model_dir, lr=1e-4))
    finally:
        stop_all(procs)


# --- helpers ---------------------------------------------------------------------------------------------------
async def _http(method: str, url: str, body: Any = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60.0) as client:
        return await client.request(method, url, json=body)


async def _router_engine(router_url: str) -> dict[str, Any]:
    engines = (await _http("GET", f"{router_url}/admin/v1/engines")).json()["engines"]
    assert len(engines) == 1, engines
    return dict(engines[0])


async def _wait_router_engine(router_url: str, predicate: Any, attempts: int = 600) -> None:
    for _ in range(attempts):
        with contextlib.suppress(httpx.HTTPError):
            if predicate(await _router_engine(router_url)):
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"router engine never matched: {await _router_engine(router_url)}")


async def _metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in (await _http("GET", f"{url}/metrics")).text.splitlines():
        series, _, value = line.rpartition(" ")
        if line.startswith("#") or series.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in series for key, val in labels.items()):
            total += float(value)
    return total


async def _drain_waits_cut(cluster: Cluster, reason: str) -> float:
    return await _metric(cluster.daemon.url, "miles_weightsync_drain_waits_cut_total", reason=reason)


async def _generation_check(engine_url: str) -> int:
    return (await _http("GET", f"{engine_url}/health_generate")).status_code


async def _publish_next(cluster: Cluster, client: WeightSyncClient) -> int:
    version = cluster.trainer.step() if cluster.published else 0
    result = await client.publish(JOB, version, version - 1, cluster.trainer.bf16_state())
    cluster.published.append(result.version)
    return result.version


async def _ensure_serving_a_version(cluster: Cluster, client: WeightSyncClient) -> None:
    if not cluster.published:
        version = await _publish_next(cluster, client)
        response = await client.update_engines(JOB, version)
        assert response.num_failed == 0, response


@pytest.fixture
async def held_requests(cluster: Cluster) -> AsyncIterator[Any]:
    """`await hold()` sends NUM_HELD_REQUESTS requests through the router and returns once the router counts them
    in flight (the engine is paused: it holds them); the tasks are returned to await their answers."""
    async with httpx.AsyncClient(base_url=cluster.router.url, timeout=UPDATE_HANG_GUARD_S) as client:
        tasks: list[asyncio.Task[httpx.Response]] = []

        async def hold() -> list[asyncio.Task[httpx.Response]]:
            body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 4}}
            tasks.extend(asyncio.create_task(client.post("/generate", json=body)) for _ in range(NUM_HELD_REQUESTS))
            for _ in range(300):
                if (await _router_engine(cluster.router.url))["in_flight"] == NUM_HELD_REQUESTS:
                    return tasks
                await asyncio.sleep(0.1)
            raise AssertionError(f"requests not held: {await _router_engine(cluster.router.url)}")

        yield hold
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _update_and_check_served(cluster: Cluster, client: WeightSyncClient, held: list[Any]) -> int:
    """Publish and roll out the next version with the daemon's defaults (delta, drain) under the hang guard; the
    update must succeed, every held request must get its answer, and the engine must serve again."""
    version = await _publish_next(cluster, client)
    response = await asyncio.wait_for(client.update_engines(JOB, version), UPDATE_HANG_GUARD_S)
    assert response.num_failed == 0, response
    assert [e.weight_version for e in response.engines] == [version]
    answers = await asyncio.wait_for(asyncio.gather(*held), UPDATE_HANG_GUARD_S)
    for answer in answers:  # ended by the abort pause (or served on the new weights): answered, not stuck
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta_info"]["finish_reason"]["type"] in ("abort", "length")
    info = (await _http("GET", f"{cluster.engine.url}/model_info")).json()
    assert info["weight_version"] == str(version)
    assert await _generation_check(cluster.engine.url) == 200  # resumed
    await _wait_router_engine(cluster.router.url, lambda e: e["state"] == "healthy" and e["in_flight"] == 0)
    return version


# --- tests -----------------------------------------------------------------------------------------------------
async def test_after_a_router_restart_the_next_update_resumes_the_engine_it_left_paused_without_waiting(
    cluster: Cluster, held_requests: Any
) -> None:
    async with WeightSyncClient(cluster.daemon.address) as client:
        await _ensure_serving_a_version(cluster, client)
        cluster.router.process.kill9()
        version = await _publish_next(cluster, client)
        failed = await asyncio.wait_for(client.update_engines(JOB, version), UPDATE_HANG_GUARD_S)
        assert failed.num_failed == 1 and failed.engines[0].update_failed
        assert "during quiesce" in failed.engines[0].error and "/admin/v1/engines/drain" in failed.engines[0].error
        assert await _generation_check(cluster.engine.url) == 503  # left paused by the failure path

        cluster.router.process.start()  # same port, no memory of the drain
        await _wait_router_engine(cluster.router.url, lambda e: e["state"] == "healthy")
        held = await held_requests()

        skipped_before = await _drain_waits_cut(cluster, "left_paused")
        await _update_and_check_served(cluster, client, held)
        assert await _drain_waits_cut(cluster, "left_paused") == skipped_before + 1
        assert await _drain_waits_cut(cluster, "timeout") == 0  # it did not wait for them


async def test_requests_that_outlast_drain_timeout_s_are_aborted_and_the_update_goes_on(
    cluster: Cluster, held_requests: Any
) -> None:
    """The daemon did not pause the engine (someone else did): it waits drain_timeout_s, not engine_timeout_s."""
    async with WeightSyncClient(cluster.daemon.address) as client:
        await _ensure_serving_a_version(cluster, client)
        paused = await _http("POST", f"{cluster.engine.url}/pause_generation", {"mode": "in_place"})
        assert paused.status_code == 200
        held = await held_requests()

        timeouts_before = await _drain_waits_cut(cluster, "timeout")
        await _update_and_check_served(cluster, client, held)
        assert await _drain_waits_cut(cluster, "timeout") == timeouts_before + 1
