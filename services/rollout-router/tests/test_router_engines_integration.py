"""The router as a real `miles-rollout-router` process in front of real `miles-engine --fake-model` processes.

One cluster per module (start-up is the expensive part): three engines in pool `job-a` (the default pool), one in
pool `job-b`, and a spare engine that is started but only registered at run time through gRPC RegisterEngine. The
fake model keeps the engine's real protocol, scheduler and radix cache, so `cached_tokens` is the engine's own
count. The test that kills an engine runs last and restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from miles.common.testing import ServiceProcess, free_port, wait_for_http_ready
from miles.common.testing.smoke import console_script
from miles.proto.router.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration

ENGINE_FLAGS = ("--weight-version", "0", "--fake-decode-token-cost-s", "0.002")
POOL_A, POOL_B = "job-a", "job-b"
ENGINE_MAX_RUNNING_REQUESTS = 256  # miles-engine's default, reported in /server_info
ENGINE_KV_TOKENS = 65536  # miles-engine's default max_total_tokens
# Idle connections are dropped before uvicorn's 5 s keep-alive closes them from the other side (a request sent at
# that moment would fail like a dead server).
CLIENT_LIMITS = httpx.Limits(max_connections=64, keepalive_expiry=2.0)


@dataclass
class RealEngine:
    """One miles-engine --fake-model subprocess on a free port."""

    url: str
    process: ServiceProcess

    def wait_ready(self) -> None:
        wait_for_http_ready(f"{self.url}/readyz", 120, self.process.process)

    def restart(self) -> None:
        """Start it again on the same port (after kill9) and wait until it serves."""
        self.process.start()
        self.wait_ready()


def write_fake_model_dir(out: Path) -> Path:
    """The tiny Qwen3 config and the real Qwen3 tokenizer: all that `--fake-model` reads (no weights, no torch)."""
    from miles.engine.tiny_model import TINY_QWEN3_CONFIG, TOKENIZER_FILES, qwen3_tokenizer_dir

    (out / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    for name in TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer_dir() / name, out / name)
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RealEngine]]:
    """Five engines, started at once (their start-ups overlap), stopped together at the end of the module."""
    model_dir = write_fake_model_dir(tmp_path_factory.mktemp("fake-model"))
    log_dir = tmp_path_factory.mktemp("engine-logs")
    started: list[RealEngine] = []
    try:
        for _ in range(5):
            port = free_port()
            argv = [console_script("miles-engine"), "--model-path", str(model_dir), "--port", str(port)]
            process = ServiceProcess(
                [*argv, "--fake-model", *ENGINE_FLAGS], ready_url=None, log_path=log_dir / f"engine-{port}.log"
            )
            started.append(RealEngine(f"http://127.0.0.1:{port}", process.start()))
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started:  # SIGTERM all first: their shutdowns overlap
            if engine.process.is_running():
                os.killpg(engine.process.pid, signal.SIGTERM)
        for engine in started:
            engine.process.stop()


@dataclass
class Cluster:
    pool_a: list[RealEngine]
    pool_b: RealEngine
    spare: RealEngine
    url: str
    client: httpx.Client
    admin: router_pb2_grpc.RouterAdminServiceStub
    router: ServiceProcess

    def generate(self, body: dict[str, Any], *, key: str | None = None, pool: str | None = None) -> httpx.Response:
        headers = {}
        if key is not None:
            headers["X-SMG-Routing-Key"] = key
        if pool is not None:
            headers["X-Miles-Pool"] = pool
        return self.client.post("/generate", content=json.dumps(body), headers=headers)

    def stats(self, pool: str = POOL_A) -> router_pb2.StatsResponse:
        return self.admin.Stats(router_pb2.StatsRequest(pool=pool), timeout=10)

    def engines(self, pool: str = "") -> dict[str, router_pb2.EngineInfo]:
        listed = self.admin.ListEngines(router_pb2.ListEnginesRequest(pool=pool), timeout=10)
        return {engine.url: engine for engine in listed.engines}


@pytest.fixture(scope="module")
def cluster(engines: list[RealEngine], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pool_a, pool_b, spare = engines[:3], engines[3], engines[4]
    port, grpc_port = free_port(), free_port()
    env = {
        "MILES_ROUTER_PORT": str(port),
        "MILES_ROUTER_ADMIN_GRPC_PORT": str(grpc_port),
        "MILES_ROUTER_DEFAULT_POOL": POOL_A,
        "MILES_ROUTER_STATIC_ENGINES": json.dumps({POOL_A: [e.url for e in pool_a], POOL_B: [pool_b.url]}),
        "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "0.2",
        "MILES_ROUTER_HEALTH_CHECK_TIMEOUT_S": "2",
        "MILES_ROUTER_VERSION_POLL_INTERVAL_S": "0.2",
        "MILES_ROUTER_RETRY_BACKOFF_INITIAL_S": "0.01",
        "MILES_ROUTER_RETRY_BACKOFF_MAX_S": "0.05",
        "MILES_ROUTER_LOG_JSON": "false",
    }
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("router-logs") / "router.log"
    with (
        ServiceProcess(
            [console_script("miles-rollout-router")], ready_url=f"{url}/readyz", env=env, log_path=log_path
        ) as router,
        httpx.Client(base_url=url, timeout=60.0, limits=CLIENT_LIMITS) as client,
        grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel,
    ):
        yield Cluster(pool_a, pool_b, spare, url, client, router_pb2_grpc.RouterAdminServiceStub(channel), router)


# --- helpers ---------------------------------------------------------------------------------------------------------
def fresh_tokens(rng: random.Random, num_tokens: int) -> list[int]:
    """Token ids no other test uses (so a cache hit can only come from this session's own history)."""
    return [rng.randrange(1000, 150_000) for _ in range(num_tokens)]


def turn(input_ids: list[int], max_new_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}


def engine_requests(url: str) -> float:
    """Requests the engine itself finished (its sglang:num_requests_total)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sglang:num_requests_total{"):
            return float(line.split()[-1])
    return 0.0


def sse_events(raw: str) -> list[Any]:
    """The JSON payloads of an SSE body, without the final [DONE]."""
    events = [block.removeprefix("data: ") for block in raw.split("\n\n") if block.startswith("data: ")]
    return [json.loads(event) for event in events if event != "[DONE]"]


def wait_for(predicate: Any, attempts: int = 300) -> None:
    for _ in range(attempts):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


# --- data plane over real engines ------------------------------------------------------------------------------------
def test_sessions_stick_and_each_turn_reuses_the_previous_one(cluster: Cluster) -> None:
    rng = random.Random(1)
    before = cluster.stats()
    keys_before = {url: info.num_sticky_keys for url, info in cluster.engines(POOL_A).items()}
    prompts = {f"stick-{i}": fresh_tokens(rng, 40) for i in range(6)}
    for number in range(4):
        for key, prompt in prompts.items():
            streamed = number % 2 == 1
            response = cluster.generate(turn(prompt, stream=streamed), key=key)
            assert response.status_code == 200, response.text
            answer = sse_events(response.text)[-1] if streamed else response.json()
            if number > 0:  # the engine's own count: previous prompt + previous output - 1
                assert answer["meta_info"]["cached_tokens"] == len(prompt) - 3 - 1
            prompts[key] = prompt + answer["output_ids"] + fresh_tokens(rng, 3)
    after = cluster.stats()
    hits, misses = (
        after.sticky_hits_total - before.sticky_hits_total,
        after.sticky_misses_total - before.sticky_misses_total,
    )
    assert (after.sticky_new_keys_total - before.sticky_new_keys_total, hits, misses) == (6, 18, 0)
    cached = after.cached_tokens_total - before.cached_tokens_total
    assert cached == sum(40 + 8 * n + 3 * (n - 1) - 1 for n in range(1, 4)) * 6  # router read every count
    gained = [url for url, info in cluster.engines(POOL_A).items() if info.num_sticky_keys > keys_before[url]]
    assert len(gained) >= 2, "new sessions go to the least-loaded engines"


def test_min_weight_version_is_409_until_an_engine_is_updated(cluster: Cluster) -> None:
    target = cluster.pool_a[1]
    wanted = max(info.weight_version for info in cluster.engines(POOL_A).values()) + 1
    body = turn(fresh_tokens(random.Random(2), 16), min_weight_version=wanted)
    refused = cluster.generate(body)
    assert refused.status_code == 409 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "weight_version_too_old"
    assert f">= {wanted}" in refused.json()["error"]["message"]
    by_header = cluster.client.post(
        "/generate", json=turn([5, 6, 7]), headers={"X-Miles-Min-Weight-Version": str(wanted)}
    )
    assert by_header.status_code == 409

    updated = httpx.post(f"{target.url}/update_weight_version", json={"new_version": str(wanted)}, timeout=30)
    assert updated.json()["success"] is True
    wait_for(lambda: cluster.engines(POOL_A)[target.url].weight_version == wanted)  # the router's version poll
    served = cluster.generate(body)
    assert served.status_code == 200, served.text
    assert served.json()["meta_info"]["weight_version"] == str(wanted)  # only the updated engine qualifies
    assert cluster.generate(body, pool=POOL_B).status_code == 409  # versions are per pool too


def test_pools_are_isolated(cluster: Cluster) -> None:
    everyone = [*cluster.pool_a, cluster.pool_b, cluster.spare]
    before = {engine.url: engine_requests(engine.url) for engine in everyone}
    stats_b = cluster.stats(POOL_B)
    rng = random.Random(3)
    for index in range(4):
        key = f"same-key-in-both-pools-{index}"
        assert cluster.generate(turn(fresh_tokens(rng, 12)), key=key, pool=POOL_B).status_code == 200
        assert cluster.generate(turn(fresh_tokens(rng, 12)), key=key).status_code == 200  # default pool: job-a
    delta = {engine.url: engine_requests(engine.url) - before[engine.url] for engine in everyone}
    assert delta[cluster.pool_b.url] == 4
    assert sum(delta[engine.url] for engine in cluster.pool_a) == 4
    assert delta[cluster.spare.url] == 0
    assert list(cluster.engines(POOL_B)) == [cluster.pool_b.url]
    assert cluster.stats(POOL_B).requests_total - stats_b.requests_total == 4


def test_malformed_json_gets_the_engines_400_unchanged(cluster: Cluster) -> None:
    for body in (b'{"input_ids": [1, 2,', b'{"input_ids": "not token ids"}'):
        direct = httpx.post(f"{cluster.pool_b.url}/generate", content=body, timeout=30)
        routed = cluster.client.post("/generate", content=body)
        assert direct.status_code == routed.status_code == 400
        assert routed.content == direct.content
        assert routed.headers["content-type"] == direct.headers["content-type"]


def test_unknown_paths_are_404(cluster: Cluster) -> None:
    assert cluster.client.post("/v1/embeddings", json={"input": "x"}).status_code == 404
    assert cluster.client.get("/nope").status_code == 404
    assert cluster.client.get("/generate").status_code == 405


def test_no_routable_engine_is_503_with_a_clear_message(cluster: Cluster) -> None:
    unknown = cluster.generate(turn([1, 2, 3]), pool="job-unknown")
    assert unknown.status_code == 503
    assert unknown.json()["error"]["code"] == "no_routable_engine"
    assert "no engine pool named 'job-unknown'" in unknown.json()["error"]["message"]

    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    registered = cluster.client.post("/admin/v1/engines", json={"pool": "job-dead", "url": dead_url})
    assert registered.json()["engine"]["state"] == "unhealthy"
    before = {engine.url: engine_requests(engine.url) for engine in [*cluster.pool_a, cluster.pool_b]}
    try:
        refused = cluster.generate(turn([1, 2, 3]), pool="job-dead")
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "pool 'job-dead' has no available engine (1 unhealthy)"
        assert {engine.url: engine_requests(engine.url) for engine in [*cluster.pool_a, cluster.pool_b]} == before
    finally:
        cluster.client.post("/admin/v1/engines/deregister", json={"pool": "job-dead", "url": dead_url})
    # The pool went with its last engine (a job's pool ends with the job): no empty pool is left behind.
    gone = cluster.generate(turn([1, 2, 3]), pool="job-dead")
    assert "no engine pool named 'job-dead'" in gone.json()["error"]["message"], gone.text
    pools = {entry["pool"] for entry in cluster.client.get("/admin/v1/engines").json()["engines"]}
    assert "job-dead" not in pools and POOL_A in pools


def test_an_engine_registered_at_run_time_takes_new_sessions(cluster: Cluster) -> None:
    rng = random.Random(4)
    spare = cluster.spare
    existing = {f"before-{i}": fresh_tokens(rng, 30) for i in range(6)}  # every engine now has >= 2 sessions
    for key, prompt in existing.items():
        answer = cluster.generate(turn(prompt), key=key).json()
        existing[key] = prompt + answer["output_ids"] + fresh_tokens(rng, 2)

    newest = set_version(spare, newest_version(cluster, POOL_A))  # as weight-sync brings a joining engine up
    reply = cluster.admin.RegisterEngine(router_pb2.RegisterEngineRequest(pool=POOL_A, url=spare.url), timeout=30)
    try:
        info = reply.engine
        assert info.state == router_pb2.ENGINE_STATE_HEALTHY and info.source == router_pb2.ENGINE_SOURCE_ADMIN
        assert (info.weight_version, info.max_concurrency) == (newest, ENGINE_MAX_RUNNING_REQUESTS)
        assert info.admit_at_weight_version == 0
        assert info.kv_capacity_tokens == ENGINE_KV_TOKENS
        served_before = engine_requests(spare.url)
        for index in range(2):
            prompt = fresh_tokens(rng, 30)
            answer = cluster.generate(turn(prompt), key=f"after-{index}").json()
            second = cluster.generate(turn(prompt + answer["output_ids"] + [7, 8]), key=f"after-{index}").json()
            assert second["meta_info"]["cached_tokens"] == 30 + 8 - 1
        assert engine_requests(spare.url) - served_before == 4  # both new sessions, both turns
        assert cluster.engines(POOL_A)[spare.url].num_sticky_keys == 2
        for key, prompt in existing.items():  # sessions placed before it joined stay where their cache is
            cached = cluster.generate(turn(prompt), key=key).json()["meta_info"]["cached_tokens"]
            assert cached == len(prompt) - 2 - 1
        assert engine_requests(spare.url) - served_before == 4
    finally:
        cluster.admin.DeregisterEngine(router_pb2.DeregisterEngineRequest(pool=POOL_A, url=spare.url), timeout=10)


def newest_version(cluster: Cluster, pool: str) -> int:
    return max(info.weight_version for info in cluster.engines(pool).values())


def set_version(engine: RealEngine, version: int) -> int:
    """The engine's weight-version label (what weight-sync sets after a verified load)."""
    updated = httpx.post(f"{engine.url}/update_weight_version", json={"new_version": str(version)}, timeout=30)
    assert updated.json()["success"] is True
    return version


def test_an_engine_joining_behind_the_pool_gets_no_request_until_it_reports_the_pools_version(
    cluster: Cluster,
) -> None:
    """A resize or a replaced pod adds an engine on older weights to a pool that has moved on: the router keeps it
    out of routing (listed unhealthy, `admit_at_weight_version` set) until it reports the pool's newest version,
    then it takes new sessions like any engine."""
    rng, spare = random.Random(5), cluster.spare
    newest = newest_version(cluster, POOL_A)
    if newest == 0:  # this test alone: move one engine of the pool past the initial weights first
        newest = set_version(cluster.pool_a[0], 1)
        wait_for(lambda: newest_version(cluster, POOL_A) == 1)
    set_version(spare, 0)  # a new engine starts on the initial weights
    reply = cluster.admin.RegisterEngine(router_pb2.RegisterEngineRequest(pool=POOL_A, url=spare.url), timeout=30)
    try:
        info = reply.engine
        assert (info.state, info.weight_version) == (router_pb2.ENGINE_STATE_UNHEALTHY, 0)
        assert info.admit_at_weight_version == newest
        served_before = engine_requests(spare.url)
        for index in range(6):  # new sessions: least-loaded placement would have put them on the empty engine
            response = cluster.generate(turn(fresh_tokens(rng, 20)), key=f"joining-{index}")
            assert response.status_code == 200
        assert engine_requests(spare.url) == served_before

        set_version(spare, newest)
        wait_for(lambda: cluster.engines(POOL_A)[spare.url].state == router_pb2.ENGINE_STATE_HEALTHY)
        assert cluster.engines(POOL_A)[spare.url].admit_at_weight_version == 0
        for index in range(2):
            cluster.generate(turn(fresh_tokens(rng, 20)), key=f"admitted-{index}")
        assert engine_requests(spare.url) > served_before
    finally:
        cluster.admin.DeregisterEngine(router_pb2.DeregisterEngineRequest(pool=POOL_A, url=spare.url), timeout=10)


# --- a paused engine and a router that starts after the pause ---------------------------------------------------------
def engine_paused_gauge(router_url: str, engine_url: str) -> float | None:
    """The router's miles_router_engine_paused for one engine, the largest over the pools it is in (each pool checks
    its own copy on its own schedule; None when no series exists)."""
    values = [
        float(line.split()[-1])
        for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines()
        if line.startswith("miles_router_engine_paused{") and f'engine="{engine_url}"' in line
    ]
    return max(values) if values else None


def test_a_router_started_after_an_engine_was_paused_routes_nothing_to_it_until_it_continues(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The router-restart fault: an engine left paused (SGLang holds requests while paused, and still answers
    /health) must not get requests from a router that did not see the pause happen."""
    paused, serving = cluster.spare, cluster.pool_b  # the spare is in no pool of the module's router
    port = free_port()
    env = {
        "MILES_ROUTER_PORT": str(port),
        "MILES_ROUTER_ADMIN_GRPC_PORT": "-1",
        "MILES_ROUTER_DEFAULT_POOL": "mixed",
        "MILES_ROUTER_STATIC_ENGINES": json.dumps({"mixed": [paused.url, serving.url], "solo": [paused.url]}),
        "MILES_ROUTER_POLICY": "round_robin",
        "MILES_ROUTER_HEALTH_CHECK_INTERVAL_S": "0.2",
        "MILES_ROUTER_HEALTH_CHECK_TIMEOUT_S": "2",
        "MILES_ROUTER_LOG_JSON": "false",
    }
    url = f"http://127.0.0.1:{port}"
    assert httpx.post(f"{paused.url}/pause_generation", json={"mode": "abort"}, timeout=30).status_code == 200
    try:
        with (
            ServiceProcess(
                [console_script("miles-rollout-router")],
                ready_url=f"{url}/readyz",
                env=env,
                log_path=tmp_path / "router.log",
            ),
            httpx.Client(base_url=url, timeout=60.0, limits=CLIENT_LIMITS) as client,
        ):
            listed = {
                e["url"]: e["state"]
                for e in client.get("/admin/v1/engines", params={"pool": "mixed"}).json()["engines"]
            }
            assert listed == {paused.url: "unhealthy", serving.url: "healthy"}  # the admin contract has no "paused"
            assert engine_paused_gauge(url, paused.url) == 1.0

            before = {engine.url: engine_requests(engine.url) for engine in (paused, serving)}
            rng = random.Random(6)
            for _ in range(6):  # round robin would alternate between the two engines
                answer = client.post("/generate", json=turn(fresh_tokens(rng, 8), 4))
                assert answer.status_code == 200, answer.text
                assert answer.json()["meta_info"]["finish_reason"]["type"] == "length"
            refused = client.post("/generate", json=turn([1, 2, 3], 4), headers={"X-Miles-Pool": "solo"})
            assert refused.status_code == 503
            assert refused.json()["error"]["message"] == "pool 'solo' has no available engine (1 paused)"
            assert engine_requests(serving.url) - before[serving.url] == 6
            assert engine_requests(paused.url) == before[paused.url]  # nothing reached (or waits at) the paused one

            assert httpx.post(f"{paused.url}/continue_generation", json={}, timeout=30).status_code == 200
            wait_for(lambda: engine_paused_gauge(url, paused.url) == 0.0)  # re-checked every health interval
            served = client.post("/generate", json=turn([1, 2, 3], 4), headers={"X-Miles-Pool": "solo"})
            assert served.status_code == 200, served.text
            assert served.json()["meta_info"]["finish_reason"]["type"] == "length"
            assert engine_requests(paused.url) == before[paused.url] + 1
            states = {e["url"]: e["state"] for e in client.get("/admin/v1/engines").json()["engines"]}
            assert states == {paused.url: "healthy", serving.url: "healthy"}
    finally:
        httpx.post(f"{paused.url}/continue_generation", json={}, timeout=30)


# --- failure: kill -9 one engine under concurrent traffic (runs last; restarts the engine) -------------------------
@dataclass
class TrafficLog:
    non_stream_statuses: list[int] = field(default_factory=list)
    complete_streams: int = 0
    broken_streams_after_output: int = 0
    failures: list[str] = field(default_factory=list)
    turns_done: int = 0


async def _session(client: httpx.AsyncClient, key: str, stream: bool, log: TrafficLog, rng: random.Random) -> None:
    prompt = fresh_tokens(rng, 60)
    done = 0
    while done < 6:
        body = json.dumps(turn(prompt, 24, stream=stream))
        response = await client.post("/generate", content=body, headers={"X-SMG-Routing-Key": key})
        if not stream:
            log.non_stream_statuses.append(response.status_code)
            if response.status_code != 200:
                log.failures.append(f"{key}: HTTP {response.status_code} {response.text[:200]}")
                return
            output_ids = response.json()["output_ids"]
        else:
            events = sse_events(response.text)
            if response.status_code != 200 or not events:
                log.failures.append(f"{key}: stream HTTP {response.status_code} {response.text[:200]}")
                return
            if "error" in events[-1]:
                # The engine died after this stream had started: the router cannot retry it, the client does.
                if events[-1]["error"]["type"] != "engine_stream_broken" or len(events) < 2:
                    log.failures.append(f"{key}: stream broke before any output: {events[-1]}")
                    return
                log.broken_streams_after_output += 1
                continue
            log.complete_streams += 1
            output_ids = events[-1]["output_ids"]
        assert len(output_ids) == 24
        prompt = prompt + output_ids + fresh_tokens(rng, 4)
        done += 1
        log.turns_done += 1


async def test_killing_an_engine_mid_run_loses_no_request_that_had_not_started_streaming(cluster: Cluster) -> None:
    victim = cluster.pool_a[0]
    before = cluster.stats()
    log = TrafficLog()
    rng = random.Random(5)

    async def kill_when_busy(client: httpx.AsyncClient) -> int:
        for _ in range(2000):
            engines = (await client.get("/admin/v1/engines", params={"pool": POOL_A})).json()["engines"]
            in_flight = next(e["in_flight"] for e in engines if e["url"] == victim.url)
            if in_flight >= 3:  # 3 of the 12 sessions stream, spread over 3 engines: some are not streams
                await asyncio.to_thread(victim.process.kill9)
                return int(in_flight)
            await asyncio.sleep(0.01)
        raise AssertionError("the victim never had requests in flight")

    try:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60.0, limits=CLIENT_LIMITS) as client:
            sessions = [_session(client, f"kill-{i}", i % 4 == 0, log, random.Random(rng.random())) for i in range(12)]
            results = await asyncio.gather(kill_when_busy(client), *sessions)
        assert results[0] >= 3
        assert log.failures == []
        assert log.turns_done == 12 * 6  # every session finished every turn
        assert set(log.non_stream_statuses) == {200}  # nothing that had not streamed was lost
        assert log.complete_streams >= 3 * 6  # streams work on, whatever broke when the engine died
        wait_for(lambda: cluster.engines(POOL_A)[victim.url].state == router_pb2.ENGINE_STATE_UNHEALTHY)
        after = cluster.stats()
        assert after.retries_total > before.retries_total  # in-flight and newly routed requests moved
        assert after.sticky_misses_total > before.sticky_misses_total  # the victim's sessions re-homed
    finally:
        if not victim.process.is_running():
            victim.restart()
    # Back on its initial weights, it serves again once at the pool's version (what weight-sync's reconcile does).
    newest = max(info.weight_version for url, info in cluster.engines(POOL_A).items() if url != victim.url)
    set_version(victim, newest)
    wait_for(lambda: cluster.engines(POOL_A)[victim.url].state == router_pb2.ENGINE_STATE_HEALTHY)
