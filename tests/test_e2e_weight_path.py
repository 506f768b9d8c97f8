"""Acceptance of the weight path on the local backend: the trainer's versions are exactly what the engines serve.

A job runs on the real local backend (in this process) over the real shared services of the `stack` fixture:
two `miles-engine` processes with the tiny Qwen3 model (real weights), the job's weight-sync origin, a rollout
worker and the trainer, async mode, 10+ steps, the `stream` transport (trainer -> origin -> engines). While it
runs, every engine's `/weights_checker` is polled: each answer carries the version the engine reports and the
digest of the weights it holds at that moment (read together, between two scheduler steps).

Checked against the trainer's own record (its publish ledger: the digest it computed for each version):
- versions are 0..N without a gap, and no number was published with two different weights;
- every (version, digest) an engine reported is the trainer's digest of that version, bit-exact in the publish
  dtype: no engine ever served a version whose weights it did not hold;
- the engines followed the trainer (each served several versions and ends on the last one), and weight-sync's
  store agrees (latest version and its digest, superseded ranges).

The second job kills the trainer with SIGKILL in the middle of publishing a version (a crash point armed through
the environment) after a checkpoint interval of 2: the local backend restarts it, it restores the older
checkpoint and, since the dead process had already published a version above it, publishes the restored
weights under the next number (a rewind) instead of reusing one; the superseded version is recorded by the
trainer and by weight-sync, and all of the above still holds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import JobProgress, SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.trainer.publish_ledger import PublishLedger, VersionRecord

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_STEPS = 10


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=False)


@dataclass(frozen=True)
class Seen:
    engine_url: str
    version: int
    digest: str
    exact: bool


class DigestWatcher(threading.Thread):
    """Polls every engine of the job for (version, digest) until stopped."""

    def __init__(self, engine_urls: Callable[[], list[str]]) -> None:
        super().__init__(daemon=True)
        self.engine_urls = engine_urls
        self.seen: list[Seen] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopped.is_set():
                for url in self.engine_urls():
                    try:
                        response = client.post(
                            f"{url}/weights_checker", json={"action": "checksum", "dtype": "bfloat16"}
                        )
                    except httpx.HTTPError:
                        continue  # starting, or restarting
                    if response.status_code == 200:
                        payload = response.json()["payload"]
                        version = int(payload["weight_version"])
                        self.seen.append(Seen(url, version, payload["digest"], payload["exact"]))
                self.stopped.wait(0.5)


def job_spec(model: Path, **train: Any) -> JobSpec:
    rollout = {
        "dataset": {"path": str(REPO_ROOT / "examples/math_single_turn/data.jsonl"), "num_epochs": 100},
        "agent": {"function": "math_single_turn.agent:agent", "python_path": [str(REPO_ROOT / "examples")]},
        "reward": {
            "type": "function",
            "function": "e2e_rollout_agents:token_parity_reward",
            "python_path": [str(REPO_ROOT / "tests")],
        },
        "n_samples_per_prompt": 2,
        "request_kwargs": {"temperature": 1.0, "max_tokens": 6},
        "concurrency": {"max_live_episodes": 4},
    }
    recipe = {"num_steps": NUM_STEPS, "batch_size_groups": 2, "mode": "async", "max_staleness": 2, "pull_wait_s": 1}
    return JobSpec.model_validate(
        {
            "model": {"path": str(model), "chat_template_kwargs": {"enable_thinking": False}},
            "rollout": rollout,
            "train": {**recipe, "optimizer": {"lr": 1e-3}, **train},
            "weight_sync": {"transport": "stream"},
            "resources": {"engines": {"replicas": 2}},
        }
    )


def run_job(stack: Any, tmp_path: Path, job_id: str, spec: JobSpec) -> tuple[list[Seen], Any, Path]:
    """Run the job to success while watching its engines; returns what was seen, weight-sync's status, job dir."""
    from miles.weightsync.client import WeightSyncClient

    stack.register_job(job_id, engine_pool=job_id)
    services = SharedServices(
        stack.redis_url, stack.router_url, "", stack.session_url, stack.operator_token, stack.buffer_address, "", ""
    )
    loop = asyncio.new_event_loop()
    backend = LocalJobBackend(services, tmp_path / "state", cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    watcher = DigestWatcher(lambda: backend.endpoints(job_id).get("engines", []))
    try:
        loop.run_until_complete(backend.start(job_id, spec))
        watcher.start()
        progress = _wait(loop, backend, job_id, spec, lambda p: p.phase in ("succeeded", "failed"))
        assert progress.phase == "succeeded", progress
        last = progress.weight_version
        _wait(loop, backend, job_id, spec, lambda p: all(s.version == last for s in _latest(watcher.seen).values()))
        origin = backend.endpoints(job_id)["weightsync_address"]

        async def status() -> Any:
            async with WeightSyncClient(origin) as client:
                return await client.get_version(job_id)

        store = loop.run_until_complete(status())
    finally:
        watcher.stopped.set()
        loop.run_until_complete(backend.stop(job_id))
        loop.run_until_complete(backend.close())
        loop.close()
    return watcher.seen, store, backend.job_dir(job_id)


def _latest(seen: list[Seen]) -> dict[str, Seen]:
    latest: dict[str, Seen] = {}
    for entry in seen:
        latest[entry.engine_url] = entry
    return latest


def _wait(
    loop: asyncio.AbstractEventLoop, backend: LocalJobBackend, job_id: str, spec: JobSpec, done: Callable[..., bool]
) -> JobProgress:
    deadline = time.monotonic() + 600  # a ceiling only, so that a hang shows the logs
    while True:
        progress: JobProgress = loop.run_until_complete(backend.observe(job_id, spec))
        if done(progress):
            return progress
        if time.monotonic() > deadline:
            logs = {p.name: p.read_text()[-2000:] for p in backend.job_dir(job_id).glob("*.log")}
            raise AssertionError(f"last progress {progress}; logs: {json.dumps(logs, indent=1)}")
        time.sleep(0.5)


def check_honest(seen: list[Seen], store: Any, records: list[VersionRecord], num_engines: int) -> dict[int, str]:
    digests: dict[int, set[str]] = {}
    for record in records:
        digests.setdefault(record.version, set()).add(record.weights_digest)
    assert all(len(found) == 1 for found in digests.values()), f"a version number carried two contents: {digests}"
    published = {version: found.pop() for version, found in digests.items()}
    last = max(published)
    assert sorted(published) == list(range(last + 1)), "a version was skipped"
    assert store.latest_version == last and store.latest_weights_digest == published[last]
    assert seen, "no engine answered /weights_checker"
    for entry in seen:
        assert entry.exact, entry  # the engine holds bf16 values: the digest is of exactly what it serves
        assert entry.digest == published.get(entry.version), f"{entry} is not the trainer's version {entry.version}"
    by_engine = {url: {e.version for e in seen if e.engine_url == url} for url in {e.engine_url for e in seen}}
    assert len(by_engine) == num_engines
    for url, versions in by_engine.items():
        assert last in versions and len(versions) >= 3, (url, sorted(versions))
    return published


def test_every_version_an_engine_serves_is_the_one_the_trainer_published(stack: Any, tmp_path: Path) -> None:
    seen, store, job_dir = run_job(stack, tmp_path, "job-weights-a", job_spec(stack.model_dir))
    records = PublishLedger(job_dir / "checkpoints").records()
    published = check_honest(seen, store, records, num_engines=2)
    assert max(published) == NUM_STEPS and list(store.superseded) == []
    print(f"observed {len(seen)} (engine, version, digest) answers over {len(published)} versions")


def test_a_trainer_killed_mid_publish_resumes_without_reusing_a_version(
    stack: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crash_version = 6  # checkpoints at 2, 4, 6 ...: the restart restores 4 while 5 was published
    monkeypatch.setenv("MILES_FAULTS", f"weightsync.client.publish.mid_transfer={crash_version}")
    monkeypatch.setenv("MILES_FAULTS_ONCE_DIR", str(tmp_path))
    spec = job_spec(stack.model_dir, checkpoint_interval_steps=2)
    seen, store, job_dir = run_job(stack, tmp_path, "job-weights-b", spec)
    assert (tmp_path / f"weightsync.client.publish.mid_transfer={crash_version}.fired").is_file()
    ledger = PublishLedger(job_dir / "checkpoints")
    records = ledger.records()
    published = check_honest(seen, store, records, num_engines=2)
    (rewind,) = [r for r in records if r.restored_from_version is not None]
    assert (rewind.version, rewind.restored_from_version) == (crash_version, crash_version - 2)
    assert published[crash_version] == published[crash_version - 2]  # the restored weights, under a new number
    assert [(r.first_version, r.last_version, r.by_version) for r in store.superseded] == [
        (crash_version - 1, crash_version - 1, crash_version)
    ]
    assert [(r.first_version, r.last_version, r.by_version) for r in ledger.superseded()] == [
        (crash_version - 1, crash_version - 1, crash_version)
    ]
    assert max(published) == NUM_STEPS + 2  # the rewind took one number beyond the steps' own
