"""LoRA jobs on a shared engine pool: what the controller accepts and refuses at submission and on PATCH, and what
the local backend runs for such a job (no engines or weight-sync of its own; the pool's engines with LoRA flags).

The whole flow (two jobs training on one pool of real engines) is tests/test_e2e_lora_shared_pool_jobs.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles.common.jobspec.job import JobSpec
from miles.controller.backends.base import SharedPool, SharedServices
from miles.controller.backends.local import LocalJobBackend
from miles.controller.backends.local_shared_pools import pool_engine_record
from miles.controller.backends.local_state import LocalJob

POOL = {
    "name": "qwen-lora",
    "model_path": "/models/tiny",
    "max_loaded_loras": 4,
    "max_lora_rank": 16,
    "lora_target_modules": ["q_proj", "v_proj"],
}


def pool_job_body(kit: Any, **lora: Any) -> dict[str, Any]:
    body: dict[str, Any] = kit.job_spec_body()
    body["train"] = {**body["train"], "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"], **lora}}
    body["resources"] = {"engines": {"shared_pool": "qwen-lora"}, "rollout_workers": {"replicas": 1}}
    return body


async def test_a_job_the_pool_cannot_serve_is_400_naming_the_field(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    settings = kit.make_settings(redis_url, shared_pools=[POOL])
    async with kit.running(settings, kit.FakeBackend(auto_step=False)) as client:
        body = pool_job_body(kit)
        no_lora = {**body, "train": {key: v for key, v in body["train"].items() if key != "lora"}}
        own_engines = {**body, "resources": {"engines": {"shared_pool": "qwen-lora", "replicas": 2}}}
        cases = [
            ({**body, "resources": {"engines": {"shared_pool": "other"}}}, "resources.engines.shared_pool", "'other'"),
            ({**body, "model": {"path": "/models/big", "family": "qwen3"}}, "model.path", "/models/tiny"),
            (pool_job_body(kit, rank=32), "train.lora.rank", "max_lora_rank 16"),
            (pool_job_body(kit, target_modules=["q_proj", "k_proj"]), "train.lora.target_modules", "['k_proj']"),
            (no_lora, "resources.engines.shared_pool", "train.lora"),
            (own_engines, "resources.engines.replicas", "has none"),
        ]
        for bad, field, said in cases:
            response = await client.post("/v1/jobs", json=bad)
            assert response.status_code == 400, (field, response.text)
            error = response.json()["error"]
            assert error["field"] == field and said in error["message"], error
        assert (await client.get("/v1/jobs")).json()["jobs"] == []  # nothing refused was stored


async def test_the_pools_adapter_slots_bound_its_jobs_and_its_size_is_not_a_jobs_to_patch(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    settings = kit.make_settings(redis_url, shared_pools=[POOL])
    async with kit.running(settings, kit.FakeBackend(auto_step=False)) as client:
        job_ids = []
        for _ in range(2):  # max_loaded_loras 4, 2 versions loaded per job
            response = await client.post("/v1/jobs", json=pool_job_body(kit))
            assert response.status_code == 201, response.text
            job_ids.append(response.json()["job_id"])
        full = await client.post("/v1/jobs", json=pool_job_body(kit))
        assert full.status_code == 429 and "qwen-lora" in full.json()["error"]["message"], full.text
        own = await client.post("/v1/jobs", json=kit.job_spec_body())  # a job with its own engines is not counted
        assert own.status_code == 201, own.text

        resized = await client.patch(f"/v1/jobs/{job_ids[0]}", json={"engines": 3})
        assert resized.status_code == 400 and resized.json()["error"]["field"] == "engines", resized.text
        workers = await client.patch(f"/v1/jobs/{job_ids[0]}", json={"rollout_workers": 2})
        assert workers.status_code == 202, workers.text

        await kit.wait_for_state(client, job_ids[0], "RUNNING")
        await client.post(f"/v1/jobs/{job_ids[0]}/cancel")
        await kit.wait_for_state(client, job_ids[0], "CANCELLED")
        again = await client.post("/v1/jobs", json=pool_job_body(kit))  # a slot freed by the ended job
        assert again.status_code == 201, again.text


def test_the_local_backend_plans_no_engines_for_a_pool_job_and_lora_flags_for_the_pool(
    tmp_path: Path, controller_kit: Any
) -> None:
    pool = SharedPool.model_validate({**POOL, "extra_args": ["--deterministic"]})
    shared = SharedServices(
        redis_url="redis://127.0.0.1:1/0",
        router_url="http://127.0.0.1:2",
        router_admin_address="",
        session_url="http://127.0.0.1:3",
        session_operator_token="operator-token-0123456789",
        buffer_address="127.0.0.1:4",
        sandbox_address="",
        sandbox_http_url="",
        shared_pools=(pool,),
    )
    backend = LocalJobBackend(shared, tmp_path)
    spec = JobSpec.model_validate(pool_job_body(controller_kit))
    job = LocalJob("job-1", backend.job_dir("job-1"))
    backend._plan(job, spec)
    assert sorted(job.processes) == ["trainer", "worker-0"] and job.shared_pool == "qwen-lora"
    trainer = job.processes["trainer"]
    config = json.loads(Path(trainer.env["MILES_TRAINER_CONFIG_FILE"]).read_text())
    assert config["publish"] == {
        "kind": "adapter",
        "dtype": "bfloat16",
        "router_url": "http://127.0.0.1:2",
        "pool": "qwen-lora",
        "session_url": "http://127.0.0.1:3",
        "dir": str(job.job_dir / "published"),
    }
    assert trainer.env["MILES_TRAINER_SESSION_OPERATOR_TOKEN"] == "operator-token-0123456789"

    argv = pool_engine_record(tmp_path, pool, 0, shared.tokens).argv
    assert argv[argv.index("--model-path") + 1] == "/models/tiny"
    flags = " ".join(argv[argv.index("--enable-lora") :])
    assert flags == (
        "--enable-lora --max-loaded-loras 4 --max-loras-per-batch 4 --max-lora-rank 16 "
        "--lora-target-modules q_proj v_proj --deterministic"
    )
