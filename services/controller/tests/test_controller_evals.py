"""Evaluation results per version through the controller: what the evaluating rollout worker stores in Redis
(`miles.common.contracts.evals`) is served by `GET /v1/jobs/{id}/evals` (404 for an unknown job), announced once
as an `eval` event on the job's stream, and printed by `miles status` (`eval_lines`); an external evaluator's
score (`POST /v1/jobs/{id}/evals`, what `miles eval --job-id` sends) is stored beside them, once per version."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from miles.cli.evaluation import eval_lines
from miles.common.contracts import evals as contract
from miles.controller.evals import version_steps_key

EVALUATION = {
    "datasets": [{"name": "held", "dataset": {"path": "examples/calculator_tool/data.jsonl"}, "limit": 4}],
    "every_n_versions": 5,
    "n_samples_per_prompt": 2,
    "pass_at_k": [1, 2],
}


CHECKPOINT_SCORE = {
    "version": 10,
    "evaluator": "checkpoint",
    "seen_unix_ms": 1_000,
    "datasets": {
        "held": {"mean_reward": 0.5, "pass_at_k": {"1": 0.5}, "num_prompts": 4, "num_episodes": 4, "reasons": {"ok": 4}}
    },
}
"""What `miles eval --job-id J --version 10` sends (cli/tests/test_cli_eval_record.py builds it)."""


def stored(version: int, reward: float) -> contract.VersionEval:
    held = contract.DatasetEval(reward, {"1": reward, "2": 1.0}, 4, 8, 1, {"ok": 8})
    return contract.VersionEval(version, "scored", 2_000, 1_000, 1.0, {"held": held})


async def test_scores_per_version_are_served_announced_and_shown(redis_url: str, controller_kit: Any) -> None:
    kit = controller_kit
    backend = kit.FakeBackend()
    backend.auto_step = False
    redis = aioredis.Redis.from_url(redis_url)
    async with kit.running(kit.make_settings(redis_url), backend) as client:
        job = (await client.post("/v1/jobs", json=kit.job_spec_body(num_steps=50, evaluation=EVALUATION))).json()
        job_id = job["job_id"]
        await kit.wait_for_state(client, job_id, "RUNNING")
        empty = (await client.get(f"/v1/jobs/{job_id}/evals")).json()
        assert empty == {"job_id": job_id, "every_n_versions": 5, "evals": []}
        # As in a job, version 5's step ends before version 5 is scored: the trainer's Status first, and the
        # scores only once the supervisor recorded the step time (at its next observe, every 0.05 s). Scores
        # stored before that would be announced without a step-to-score time.
        backend.jobs[job_id].step, backend.jobs[job_id].step_finished_unix_ms = 5, 1_500
        for _ in range(1500):
            if await redis.hexists(version_steps_key(job_id), "5"):
                break
            await asyncio.sleep(0.02)
        for version, reward in ((5, 0.5), (0, 0.25)):
            await redis.hset(contract.evals_key(job_id), str(version), stored(version, reward).to_json())
        await redis.hset(contract.evals_key(job_id), "7", "not json")  # skipped, never a 500
        body = (await client.get(f"/v1/jobs/{job_id}/evals")).json()
        assert body["evals"][1]["step_to_score_s"] == 0.5  # scored at 2_000 ms, its step finished at 1_500
        assert [e["version"] for e in body["evals"]] == [0, 5]
        assert body["evals"][0]["step_to_score_s"] is None  # version 0: no step the controller saw
        assert body["evals"][1]["datasets"]["held"] == {
            "mean_reward": 0.5,
            "pass_at_k": {"1": 0.5, "2": 1.0},
            "num_prompts": 4,
            "num_episodes": 8,
            "num_discarded": 1,
            "reasons": {"ok": 8},
        }
        assert (await client.get("/v1/jobs/jnothere0000/evals")).status_code == 404
        await record_externally(client, redis, job_id)

        async def eval_events() -> list[dict[str, Any]]:
            events: list[dict[str, Any]] = []
            kind = ""
            await client.post(f"/v1/jobs/{job_id}/cancel")  # the stream ends with the job
            async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: ") and kind == "eval":
                        events.append(json.loads(line[6:]))
            return events

        await asyncio.sleep(0.5)  # a few observe intervals (0.05 s): the supervisor announces what is stored
        announced = await asyncio.wait_for(eval_events(), timeout=60)
        assert (await client.delete(f"/v1/jobs/{job_id}")).status_code == 204
        assert not await redis.exists(contract.evals_key(job_id))  # deleted with the job
        assert not await redis.exists(version_steps_key(job_id))
    await redis.aclose()
    assert sorted(e["version"] for e in announced) == [0, 5, 10, 15]  # once each
    assert announced[0]["datasets"]["held"]["num_episodes"] == 8 and announced[2]["evaluator"] == "checkpoint"
    assert [e["step_to_score_s"] for e in sorted(announced, key=lambda e: e["version"])][:2] == [None, 0.5]
    lines = eval_lines(body)
    assert lines[0] == "  eval v0: held reward 0.250 pass@1 0.25 pass@2 1.00 (8 eps, 1 discarded); lag 1.0s"
    assert lines[1] == (
        "  eval v5: held reward 0.500 pass@1 0.50 pass@2 1.00 (8 eps, 1 discarded); lag 1.0s, 0.5s after its step"
    )


async def record_externally(client: Any, redis: aioredis.Redis, job_id: str) -> None:
    """POST /v1/jobs/{id}/evals: 201 for a new version and for one the engines missed, 409 over a score, 404 for
    an unknown job, 422 for a body that breaks the schema or claims the job's own `engines`."""
    body = CHECKPOINT_SCORE
    created = await client.post(f"/v1/jobs/{job_id}/evals", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["evaluator"] == "checkpoint" and created.json()["lag_s"] > 0
    assert created.json()["datasets"]["held"]["pass_at_k"] == {"1": 0.5}
    assert (await client.post(f"/v1/jobs/{job_id}/evals", json=body)).json()["error"]["code"] == "eval_exists"
    over_score = await client.post(f"/v1/jobs/{job_id}/evals", json={**body, "version": 5})
    assert over_score.status_code == 409
    missed = contract.VersionEval(15, "missed", 2_000, 1_000, 1.0)
    await redis.hset(contract.evals_key(job_id), "15", missed.to_json())
    assert (await client.post(f"/v1/jobs/{job_id}/evals", json={**body, "version": 15})).status_code == 201
    assert (await client.post("/v1/jobs/jnothere0000/evals", json=body)).status_code == 404
    for bad in ({**body, "evaluator": "engines"}, {**body, "datasets": {"Bad Name": {}}}, {**body, "version": -1}):
        assert (await client.post(f"/v1/jobs/{job_id}/evals", json=bad)).status_code == 422
    listed = (await client.get(f"/v1/jobs/{job_id}/evals")).json()["evals"]
    assert {e["version"]: e["evaluator"] for e in listed} == {
        0: "engines",
        5: "engines",
        10: "checkpoint",
        15: "checkpoint",
    }
