"""Acceptance: two LoRA jobs train at once on one shared engine pool, each strictly on its own adapter's policy.

The controller's real pieces run in this process over the `stack`'s shared services (Redis, router, session
server, buffer, sandbox gateway): `SharedServicesClient.register` (what the supervisor calls: the session server's
job config names the shared pool and `lora_adapter`, the buffer's queue) and the `LocalJobBackend`, given one
declared shared pool of the demo's model. Each job is the `make run` demo job with `train.lora` and
`resources.engines.shared_pool`, in deterministic strictly-on-policy sync mode: the backend starts the pool's
engine once (`--enable-lora --deterministic`), and per job only its rollout worker and its trainer, whose adapter
publisher loads each version into the pool's engine and announces it to the session server.

Checked: both jobs SUCCEED at their last step and version; every step of each job has train-vs-rollout logprob
difference exactly 0 (each request was served with its own job's adapter at the version it trains: the other
job's adapter, the base model or a stale version would give other numbers) and staleness 0; neither job has
engines or a weight-sync of its own; the pool's engine outlives both jobs, and holds no adapter of theirs once they
ended (each trainer unloads its versions as it stops), until the pool is stopped.

About 4 minutes on 2 shared cores.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import JobProgress, SharedPool, SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.controller.shared import SharedServicesClient

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB_IDS = ("lora-one", "lora-two")
POOL_NAME = "demo-lora"
NUM_STEPS = 2
LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"], "dropout": 0.0}


@pytest.fixture(scope="module")
def stack_options(make_stack_options: Any) -> Any:
    return make_stack_options(engine="fake", num_engines=0, sandbox=True)


def pool_job(model: Path, seed: int) -> JobSpec:
    """The demo job with LoRA on the shared pool, deterministic and strictly on policy, cut to NUM_STEPS steps."""
    spec: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "calculator_tool" / "job.yaml").read_text())
    spec["model"]["path"] = str(model)
    spec["train"].update(
        mode="sync",
        deterministic=True,
        strict_on_policy=True,
        lora=LORA,
        num_steps=NUM_STEPS,
        batch_size_groups=1,
        checkpoint_interval_steps=NUM_STEPS,
        seed=seed,
    )
    spec["train"]["optimizer"]["lr"] = 1e-2
    spec["weight_sync"]["dtype"] = "float32"  # adapters published as the trainer computes them
    spec["resources"] = {"engines": {"shared_pool": POOL_NAME}, "rollout_workers": {"replicas": 1}}
    return JobSpec.model_validate(spec)


def services_with_pool(stack: Any, model: Path) -> SharedServices:
    pool = SharedPool(name=POOL_NAME, model_path=str(model), extra_args=["--deterministic"])
    services: SharedServices = stack.shared_services(shared_pools=(pool,))
    return services


async def run_both(
    backend: LocalJobBackend, specs: dict[str, JobSpec]
) -> tuple[dict[str, JobProgress], dict[str, dict[int, dict[str, float]]]]:
    """Observe both jobs to their end: the final progress and every step's metrics of each."""
    by_step: dict[str, dict[int, dict[str, float]]] = {job_id: {} for job_id in specs}
    final: dict[str, JobProgress] = {}
    while len(final) < len(specs):
        for job_id, spec in specs.items():
            if job_id in final:
                continue
            progress = await backend.observe(job_id, spec)
            if progress.step > 0 and "reward_mean" in progress.metrics:
                by_step[job_id][progress.step] = dict(progress.metrics)
            if progress.phase in ("succeeded", "failed"):
                final[job_id] = progress
        await asyncio.sleep(0.5)
    return final, by_step


def test_two_lora_jobs_train_strictly_on_policy_on_one_shared_pool(
    stack: Any, tmp_path: Path, demo_model: Callable[[str], Path]
) -> None:
    model = demo_model("calculator-demo")
    services = services_with_pool(stack, model)
    specs = {job_id: pool_job(model, seed=index + 1) for index, job_id in enumerate(JOB_IDS)}
    backend = LocalJobBackend(services, tmp_path / "state", cwd=REPO_ROOT, restart_backoff_initial_s=0.2)
    registrar = SharedServicesClient(services, timeout_s=60)

    async def scenario() -> tuple[dict[str, JobProgress], dict[str, dict[int, dict[str, float]]], set[str]]:
        try:
            for job_id, spec in specs.items():
                await registrar.register(job_id, spec)
                await backend.start(job_id, spec)
            final, by_step = await run_both(backend, specs)
            for job_id in specs:
                await backend.stop(job_id)
            pool_urls = backend.shared_pools.engine_urls(POOL_NAME)
            assert len(pool_urls) == 1 and backend.shared_pools.ready_engines(POOL_NAME) == 1, "the pool outlives jobs"
            async with httpx.AsyncClient(timeout=30) as http:
                info = (await http.get(f"{pool_urls[0]}/server_info")).json()
            return final, by_step, set(info["loaded_lora_adapters"])
        finally:
            for job_id in specs:
                await backend.stop(job_id)
            await backend.shared_pools.stop(POOL_NAME, grace_s=10)
            await backend.close()
            await registrar.close()

    started = time.monotonic()
    final, by_step, loaded = asyncio.run(scenario())
    print(f"two lora jobs on one pool: {time.monotonic() - started:.0f}s; loaded adapters {sorted(loaded)}")
    for job_id, progress in final.items():
        job_dir = tmp_path / "state" / "jobs" / job_id
        logs = {p.name: p.read_text(errors="replace")[-3000:] for p in job_dir.glob("*.log")}
        assert progress.phase == "succeeded", f"{job_id}: {progress}; logs: {json.dumps(logs, indent=1)}"
        assert (progress.step, progress.weight_version) == (NUM_STEPS, NUM_STEPS), (job_id, progress)
        assert sorted(logs) == ["trainer.log", "worker-0.log"], (job_id, sorted(logs))  # no engines, no origin
        assert by_step[job_id], f"{job_id}: no step observed"
        for step, metrics in by_step[job_id].items():
            assert metrics["num_loss_tokens"] > 0, (job_id, step, metrics)
            assert metrics["train_rollout_logprob_abs_diff_max"] == 0.0, (job_id, step, metrics)
            assert metrics["staleness_max"] == 0.0, (job_id, step, metrics)
    assert loaded == set(), loaded  # each trainer unloaded its versions as its job ended: the slots are free again
    assert sorted(p.name for p in (tmp_path / "state" / "pools" / POOL_NAME).glob("*.log")) == ["engine-0.log"]
