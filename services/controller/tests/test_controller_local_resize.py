"""Resizing a running job's engines on the local backend, 1 -> 2 -> 1, while requests flow through its router pool.

Every response a prober gets through the pool during the resize is read: none is served at a weight version older
than the one the pool served before the resize (the new engine starts on the initial weights, version 0, and must
get no traffic until weight-sync brought it to the job's version), none fails while the extra engine is drained and
removed (a 503 `no_routable_engine` while no engine is available, during a weight update, is retryable and
allowed); the job then trains to its last step and stopping it leaves no router pool behind.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from local_backend_testkit import REPO_ROOT, Shared, assert_all_gone, job_spec, run, start_shared, wait_for

from miles.common.contracts.headers import POOL_HEADER
from miles.common.contracts.weight_version import parse_weight_version
from miles.common.testing import RedisServer
from miles.controller.backends.local import LocalJobBackend

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_DB = 8
NUM_STEPS = 12


@pytest.fixture(scope="module")
def shared(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    running = start_shared(redis_server, tmp_path_factory.mktemp("shared"), tmp_path_factory.mktemp("model"), REDIS_DB)
    yield running
    running.stop()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    event_loop = asyncio.new_event_loop()
    asyncio.set_event_loop(event_loop)
    yield event_loop
    event_loop.close()


class Prober:
    """Sends small generate requests through the router's pool of the job, one after another, in a thread."""

    def __init__(self, router_url: str, pool: str) -> None:
        self.router_url, self.pool = router_url, pool
        self.responses: list[tuple[int, int | None, str]] = []
        """(HTTP status, the response's weight version, the error body) of every request, in order."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        with httpx.Client(base_url=self.router_url, timeout=60) as client:
            while not self._stop.is_set():
                response = client.post("/generate", json=body, headers={POOL_HEADER: self.pool})
                version, error = None, ""
                if response.status_code == 200:
                    version = parse_weight_version(response.json()["meta_info"]["weight_version"])
                else:
                    error = response.text[:300]
                self.responses.append((response.status_code, version, error))

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def pool_version(shared: Shared, job_id: str) -> int | None:
    """The lowest version the pool's available engines serve, as the router answers it."""
    response = httpx.get(f"{shared.router_url}/v1/weight_version", params={"pool": job_id}, timeout=10)
    version: int | None = response.json()["min_weight_version"]
    return version


def engine_requests(engine_url: str) -> float:
    """Finished requests of one engine (its SGLang-named counter)."""
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_requests_total"))


def test_engines_resized_mid_job_serve_only_at_the_current_version(
    shared: Shared, tmp_path: Path, loop: asyncio.AbstractEventLoop
) -> None:
    job_id = "job-local-resize"
    train = {"num_steps": NUM_STEPS, "batch_size_groups": 2, "mode": "async", "max_staleness": 2, "pull_wait_s": 1}
    spec = job_spec(shared.model, train=train)
    shared.register_job(job_id)
    backend = LocalJobBackend(shared.services(), tmp_path, cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    pids: dict[str, int] = {}
    try:
        run(backend.start(job_id, spec))
        wait_for(backend, job_id, spec, lambda p: (pool_version(shared, job_id) or 0) >= 1)
        (engine_url,) = backend.endpoints(job_id)["engines"]
        version_before = pool_version(shared, job_id)
        assert version_before is not None and version_before >= 1

        with Prober(shared.router_url, job_id) as prober:
            run(backend.resize(job_id, spec, engines=2, rollout_workers=None))
            wait_for(
                backend, job_id, spec, lambda p: p.pools.get("engines") == 2 and len(shared.pool_engines(job_id)) == 2
            )
            new_engine = next(url for url in backend.endpoints(job_id)["engines"] if url != engine_url)
            joined = wait_for(
                backend, job_id, spec, lambda p: shared.pool_engines(job_id)[new_engine]["state"] == "healthy"
            )
            # The new engine takes its share of the pool's traffic once it reports the job's version.
            wait_for(backend, job_id, spec, lambda p: engine_requests(new_engine) >= 5)
            pids = backend.pids(job_id)
            run(backend.resize(job_id, spec, engines=1, rollout_workers=None))
            shrunk = wait_for(backend, job_id, spec, lambda p: p.pools.get("engines") == 1)
            assert set(shared.pool_engines(job_id)) == {engine_url}
            num_after_shrink = len(prober.responses)
            wait_for(backend, job_id, spec, lambda p: len(prober.responses) >= num_after_shrink + 5)

        assert joined.phase == "running" and shrunk.phase == "running", "the resize was not mid-job"
        # While weight-sync drains an engine for an update and the other is still joining, the pool has no
        # available engine: the router answers 503 no_routable_engine (retryable, nothing served). Anything else
        # (an engine stopped with requests in flight, a proxy error) fails the test.
        failed = [(i, status, text) for i, (status, _, text) in enumerate(prober.responses) if status != 200]
        not_retryable = [f for f in failed if f[1] != 503 or "no_routable_engine" not in f[2]]
        assert pids["engine-1"] and not not_retryable, f"{len(failed)} of {len(prober.responses)}: {failed[:5]}"
        served = [version for status, version, _ in prober.responses if status == 200]
        behind = [version for version in served if version is None or version < version_before]
        assert not behind, f"{len(behind)} of {len(served)} responses served behind version {version_before}"

        progress = wait_for(backend, job_id, spec, lambda p: p.phase == "succeeded")
        assert progress.step == NUM_STEPS and progress.weight_version == NUM_STEPS
        pids = backend.pids(job_id)
    finally:
        run(backend.stop(job_id))
        run(backend.close())
    assert_all_gone(pids)
    assert shared.pool_engines(job_id) == {}
