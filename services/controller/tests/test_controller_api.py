"""The job API over a real controller app (real Redis, real sockets) with a fake backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration


async def test_job_runs_pending_to_running_to_succeeded_and_shows_progress(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend()
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        response = await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=3))
        assert response.status_code == 201, response.text
        job = response.json()
        assert job["state"] == "PENDING"
        assert response.headers["location"] == f"/v1/jobs/{job['job_id']}"
        done = await kit.wait_for_state(client, job["job_id"], "SUCCEEDED", "FAILED")
        assert done["state"] == "SUCCEEDED", done
        assert done["step"] == 3 and done["num_steps"] == 3 and done["weight_version"] == 3
        assert done["reward"] == pytest.approx(0.3)
        assert done["staleness"] == 0.5 and done["tito_mismatches"] == 0.0
        assert done["pools"]["engines"] == {"desired": 2, "live": 2}
        assert done["started_at_s"] is not None and done["ended_at_s"] >= done["started_at_s"]
        assert ("start", job["job_id"]) in backend.calls and ("stop", job["job_id"]) in backend.calls
        listed = (await client.get("/v1/jobs")).json()["jobs"]
        assert [item["job_id"] for item in listed] == [job["job_id"]]
        assert (await client.get("/v1/jobs", params={"state": "RUNNING"})).json()["jobs"] == []
        succeeded = (await client.get("/v1/jobs", params={"state": "SUCCEEDED"})).json()["jobs"]
        assert [item["job_id"] for item in succeeded] == [job["job_id"]]


async def test_job_api_needs_a_bearer_token_and_probes_do_not(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        base = str(client.base_url)
        async with httpx.AsyncClient(base_url=base) as anonymous:
            missing = await anonymous.get("/v1/jobs")
            assert missing.status_code == 401
            assert missing.json()["error"]["type"] == "MissingTokenError"
            wrong = await anonymous.get("/v1/jobs", headers={"authorization": "Bearer not-the-token-123456"})
            assert wrong.status_code == 401
            assert wrong.json()["error"]["type"] == "WrongTokenError"
            basic = await anonymous.post("/v1/jobs", json=kit.job_spec_body(), headers={"authorization": "Basic eA=="})
            assert basic.status_code == 401
            for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
                assert (await anonymous.get(path)).status_code == 200, path
        assert (await client.get("/v1/jobs")).status_code == 200


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"train": {"num_steps": 0}}, "body.train", "num_steps must be >= 1"),
        ({"model": {}}, "body.model.path", "Field required"),
        (
            {"rollout": {"dataset": {"path": "d.jsonl"}, "agent": {"function": "no-colon"}}},
            "body.rollout.agent.function",
            "pattern",
        ),
        ({"resources": {"engines": {"replicas": 0}}}, "body.resources.engines.replicas", "greater than or equal to 1"),
        ({"weight_sync": {"transport": "carrier-pigeon"}}, "body.weight_sync.transport", "'disk'"),
        ({"surprise": 1}, "body.surprise", "Extra inputs are not permitted"),
    ],
)
async def test_invalid_job_spec_is_422_naming_the_field(
    redis_url: str, controller_kit: Any, change: dict[str, Any], field: str, reason: str
) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        response = await client.post("/v1/jobs", json={**kit.job_spec_body(), **change})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["field"] == field
        assert reason in error["message"]
        assert (await client.get("/v1/jobs")).json()["jobs"] == []


async def test_a_correction_applied_twice_is_400_naming_the_fields(redis_url: str, controller_kit: Any) -> None:
    """old_logprobs = rollout makes the PPO ratio pi/mu already; TIS or MIS on top would weight by pi_old/mu again."""
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        body = kit.job_spec_body()
        for mode in ("tis", "mis"):
            train = {**body["train"], "loss": {"old_logprobs": "rollout"}, "correction": {"mode": mode}}
            response = await client.post("/v1/jobs", json={**body, "train": train})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["field"] == "train.correction.mode"
            assert "old_logprobs" in error["message"] and "twice" in error["message"]
        train = {**body["train"], "loss": {"old_logprobs": "rollout"}, "correction": {"mode": "none"}}
        assert (await client.post("/v1/jobs", json={**body, "train": train})).status_code == 201


async def test_lora_on_megatron_or_several_trainer_replicas_is_400_naming_train_lora(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        body = kit.job_spec_body()
        train = {**body["train"], "lora": {"rank": 4}}
        for trainer, said in (({"backend": "megatron"}, "megatron backend"), ({"replicas": 2}, "one trainer replica")):
            resources = {**body["resources"], "trainer": trainer}
            response = await client.post("/v1/jobs", json={**body, "train": train, "resources": resources})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["field"] == "train.lora" and said in response.json()["error"]["message"]
        assert (await client.post("/v1/jobs", json={**body, "train": train})).status_code == 201


async def test_lora_targets_and_rank_are_checked_against_the_models_config(
    redis_url: str, controller_kit: Any, tmp_path: Path
) -> None:
    config = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_dim": 16, "intermediate_size": 128}))
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        body = {**kit.job_spec_body(), "model": {"path": str(tmp_path), "family": "qwen3"}}
        cases = [
            ({"rank": 4, "target_modules": ["q_proj", "lm_head"]}, "train.lora.target_modules", "['lm_head']"),
            ({"rank": 33, "target_modules": ["q_proj", "k_proj"]}, "train.lora.rank", "at most 32"),  # k: 64 -> 32
        ]
        for lora, field, said in cases:
            response = await client.post("/v1/jobs", json={**body, "train": {**body["train"], "lora": lora}})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["field"] == field and said in response.json()["error"]["message"]
        fits = {"rank": 32, "target_modules": ["q_proj", "k_proj"]}
        accepted = await client.post("/v1/jobs", json={**body, "train": {**body["train"], "lora": fits}})
        assert accepted.status_code == 201, accepted.text


async def test_idempotency_key_replays_the_same_job_and_refuses_another_body(
    redis_url: str, controller_kit: Any
) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        headers = {"Idempotency-Key": "retry-me-1"}
        first = await client.post("/v1/jobs", json=kit.job_spec_body(), headers=headers)
        again = await client.post("/v1/jobs", json=kit.job_spec_body(), headers=headers)
        assert first.status_code == 201 and again.status_code == 200
        assert again.json()["job_id"] == first.json()["job_id"]
        assert again.headers["idempotent-replayed"] == "true"
        other = await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=7), headers=headers)
        assert other.status_code == 422
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        assert first.json()["job_id"] in other.json()["error"]["message"]
        fresh = await client.post("/v1/jobs", json=kit.job_spec_body(), headers={"Idempotency-Key": "another"})
        assert fresh.status_code == 201 and fresh.json()["job_id"] != first.json()["job_id"]
        assert len((await client.get("/v1/jobs")).json()["jobs"]) == 2


async def test_cancel_stops_the_backend_and_delete_needs_an_ended_job(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        refused = await client.delete(f"/v1/jobs/{job_id}")
        assert refused.status_code == 409
        assert "cancel it first" in refused.json()["error"]["message"]
        cancelled = await client.post(f"/v1/jobs/{job_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["state"] == "CANCELLED"
        assert ("stop", job_id) in backend.calls and job_id not in backend.jobs
        assert (await client.post(f"/v1/jobs/{job_id}/cancel")).json()["state"] == "CANCELLED"
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
        assert (await client.get(f"/v1/jobs/{job_id}")).status_code == 404
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 404


async def test_cancel_of_a_succeeded_job_is_a_conflict(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url), kit.FakeBackend()) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=1))).json()["job_id"]
        await kit.wait_for_state(client, job_id, "SUCCEEDED")
        response = await client.post(f"/v1/jobs/{job_id}/cancel")
        assert response.status_code == 409
        assert (await client.get(f"/v1/jobs/{job_id}")).json()["state"] == "SUCCEEDED"


async def test_patch_resizes_a_running_job_and_validates_the_sizes(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        for body, field in (
            ({}, "body"),
            ({"engines": 0}, "body.engines"),
            ({"rollout_workers": 999}, "body.rollout_workers"),
            ({"trainer": 2}, "body.trainer"),
        ):
            response = await client.patch(f"/v1/jobs/{job_id}", json=body)
            assert response.status_code == 422, body
            assert response.json()["error"]["field"] == field
        response = await client.patch(f"/v1/jobs/{job_id}", json={"engines": 4, "rollout_workers": 3})
        assert response.status_code == 202
        assert response.json()["pools"]["engines"]["desired"] == 4
        await kit.wait_until(lambda: backend.jobs[job_id].engines == 4)
        assert backend.jobs[job_id].rollout_workers == 3
        job = await client.get(f"/v1/jobs/{job_id}")
        assert job.json()["spec"]["resources"]["rollout_workers"]["replicas"] == 3
        await client.post(f"/v1/jobs/{job_id}/cancel")
        body = kit.job_spec_body()
        body.setdefault("resources", {})["rollout_workers"] = {"replicas": 1, "max_replicas": 2}
        scaled = (await client.post("/v1/jobs", json=body)).json()["job_id"]
        await kit.wait_for_state(client, scaled, "RUNNING")
        assert (await client.patch(f"/v1/jobs/{scaled}", json={"rollout_workers": 4})).status_code == 202
        workers = (await client.get(f"/v1/jobs/{scaled}")).json()["spec"]["resources"]["rollout_workers"]
        assert (workers["replicas"], workers["max_replicas"]) == (4, 4)  # the autoscaler's maximum follows
        await client.post(f"/v1/jobs/{scaled}/cancel")
        ended = await client.patch(f"/v1/jobs/{job_id}", json={"engines": 1})
        assert ended.status_code == 409
        assert (await client.patch("/v1/jobs/jdoesnotexist", json={"engines": 1})).status_code == 404


async def test_backend_failure_fails_the_job_with_the_reason(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(fail_start="model path /models/tiny is not a checkpoint")
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        job = await kit.wait_for_state(client, job_id, "FAILED")
        assert any("is not a checkpoint" in error for error in job["errors"])
        assert job["started_at_s"] is None


async def test_running_job_that_the_backend_reports_failed_becomes_failed(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend(auto_step=False)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        job_id = (await client.post("/v1/jobs", json=kit.job_spec_body())).json()["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        backend.jobs[job_id].phase = "failed"
        backend.jobs[job_id].error = "trainer exited with 1 five times"
        job = await kit.wait_for_state(client, job_id, "FAILED")
        assert "trainer exited with 1 five times" in job["errors"][-1]
        assert job_id not in backend.jobs


async def test_active_job_limit_answers_429(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    async with kit.running(kit.make_settings(redis_url, max_active_jobs=1), kit.FakeBackend(auto_step=False)) as client:
        assert (await client.post("/v1/jobs", json=kit.job_spec_body())).status_code == 201
        response = await client.post("/v1/jobs", json=kit.job_spec_body())
        assert response.status_code == 429
        assert "retry-after" in response.headers
