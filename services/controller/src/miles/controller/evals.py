"""A job's evaluation results per weight version, as the controller serves and announces them.

The evaluating rollout worker writes one `VersionEval` per evaluated version into Redis
(`miles.common.contracts.evals`, the same Redis as the controller's store); here they are read for
`GET /v1/jobs/{id}/evals` and turned into `eval` events on the job's stream by the supervisor (`EvalAnnouncer`,
once per version per controller process: a restarted controller announces the stored versions once more).
"""

from __future__ import annotations

from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, Field

from miles.common.contracts import evals as contract


class DatasetEvalView(BaseModel):
    mean_reward: float = Field(description="Mean reward of the kept episodes (failed ones score 0)")
    pass_at_k: dict[str, float] = Field(description="k -> unbiased pass@k over each prompt's episodes")
    num_prompts: int
    num_episodes: int = Field(description="Episodes scored (every turn served at this version)")
    num_discarded: int = Field(description="Episodes with a turn served at another version: not scored")
    reasons: dict[str, int] = Field(description="Scored episodes by how they ended (ok, agent_error, ...)")


class VersionEvalView(BaseModel):
    version: int = Field(description="The weight version every scored episode ran at")
    status: Literal["scored", "missed"] = Field(
        description="missed: the engines had left the version before an episode could run at it"
    )
    scored_unix_ms: int
    seen_unix_ms: int = Field(description="When the evaluating worker first saw the version served")
    lag_s: float = Field(description="scored_unix_ms - seen_unix_ms, in seconds")
    datasets: dict[str, DatasetEvalView]

    @classmethod
    def of(cls, result: contract.VersionEval) -> VersionEvalView:
        return cls.model_validate(
            {
                **result.__dict__,
                "datasets": {name: d.__dict__ for name, d in result.datasets.items()},
            }
        )


class EvalList(BaseModel):
    """`GET /v1/jobs/{id}/evals`: every evaluated version, oldest first (empty without `evaluation`)."""

    job_id: str
    every_n_versions: int | None = Field(description="The spec's evaluation.every_n_versions; null: none")
    evals: list[VersionEvalView]


async def read_evals(redis: aioredis.Redis, job_id: str) -> list[contract.VersionEval]:
    return contract.parse_evals(await redis.hgetall(contract.evals_key(job_id)))


def eval_event(job_id: str, result: contract.VersionEval) -> dict[str, Any]:
    """The `eval` event of a newly stored version (its datasets' mean reward and pass@k, and the lag)."""
    return {
        "type": "eval",
        "job_id": job_id,
        "version": result.version,
        "status": result.status,
        "lag_s": result.lag_s,
        "datasets": {
            name: {"mean_reward": d.mean_reward, "pass_at_k": d.pass_at_k, "num_episodes": d.num_episodes}
            for name, d in result.datasets.items()
        },
    }


class EvalAnnouncer:
    """Which versions of one job this controller has announced already."""

    def __init__(self) -> None:
        self.announced: set[int] = set()

    async def new_events(self, redis: aioredis.Redis, job_id: str) -> list[dict[str, Any]]:
        fresh = [r for r in await read_evals(redis, job_id) if r.version not in self.announced]
        self.announced.update(r.version for r in fresh)
        return [eval_event(job_id, r) for r in fresh]
