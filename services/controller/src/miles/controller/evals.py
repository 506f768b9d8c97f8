"""A job's evaluation results per weight version, as the controller serves, records and announces them.

The evaluating rollout worker writes one `VersionEval` per evaluated version into Redis
(`miles.common.contracts.evals`, the same Redis as the controller's store); here they are read for
`GET /v1/jobs/{id}/evals` and turned into `eval` events on the job's stream by the supervisor (`EvalAnnouncer`,
once per version per controller process: a restarted controller announces the stored versions once more).
`POST /v1/jobs/{id}/evals` (`record_eval`) stores the score of an evaluator outside the job (modes (b) and (c):
`miles eval --job-id` on a checkpoint, or any external scorer) in the same hash; one result per version, whoever
scores it first (a second score is a 409; a `missed` is replaced), so a worker that finds an external score does
not evaluate that version.
The hash is deleted with the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from typing import Annotated, Any, Literal, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from redis.exceptions import RedisError

from miles.common.contracts import evals as contract
from miles.common.errors import UnavailableError
from miles.common.jobspec.evaluation import EVAL_DATASET_NAME_PATTERN
from miles.controller.errors import EvalExistsError

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _redis(awaitable: Awaitable[T]) -> T:
    """A Redis call whose failure is a 503 (as the job store's), not a 500."""
    try:
        return await awaitable
    except (RedisError, OSError) as exc:
        raise UnavailableError(f"Redis is unavailable: {type(exc).__name__}: {exc}", retry_after_s=1.0) from exc


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
    step_to_score_s: float | None = Field(
        default=None,
        description="scored_unix_ms minus when the trainer's step that produced the version finished, in seconds "
        "(publish, weight update, the evaluation's wait and its episodes); null when the controller did not see "
        "that step's time (a version trained before a controller or trainer restart)",
    )
    datasets: dict[str, DatasetEvalView]
    evaluator: str = Field(
        default=contract.ENGINES_EVALUATOR,
        description="`engines`: the job's rollout worker on the job's own engines; else the name an external "
        "evaluator recorded the score under (POST /v1/jobs/{id}/evals)",
    )

    @classmethod
    def of(cls, result: contract.VersionEval, step_times_ms: dict[int, int] | None = None) -> VersionEvalView:
        return cls.model_validate(
            {
                **result.__dict__,
                "datasets": {name: d.__dict__ for name, d in result.datasets.items()},
                "step_to_score_s": step_to_score_s(result, step_times_ms or {}),
            }
        )


def step_to_score_s(result: contract.VersionEval, step_times_ms: dict[int, int]) -> float | None:
    step_ms = step_times_ms.get(result.version)
    if step_ms is None or result.status != "scored":
        return None
    return round((result.scored_unix_ms - step_ms) / 1000, 3)


def version_steps_key(job_id: str) -> str:
    """Hash version -> when the trainer's step that produced it finished (Unix ms), written by the controller as
    it observes the trainer (the rollout side never learns it)."""
    return f"{contract.evals_key(job_id)}:steps"


async def record_version_step(redis: aioredis.Redis, job_id: str, version: int, finished_unix_ms: int) -> None:
    """First write wins: a version's step happened once (a restarted trainer publishes under a new number)."""
    await redis.hsetnx(version_steps_key(job_id), str(version), str(finished_unix_ms))


async def read_version_steps(redis: aioredis.Redis, job_id: str) -> dict[int, int]:
    raw = await _redis(redis.hgetall(version_steps_key(job_id)))
    return {int(version): int(ms) for version, ms in raw.items()}


class EvalList(BaseModel):
    """`GET /v1/jobs/{id}/evals`: every evaluated version, oldest first (empty without `evaluation`)."""

    job_id: str
    every_n_versions: int | None = Field(description="The spec's evaluation.every_n_versions; null: none")
    evals: list[VersionEvalView]


DatasetName = Annotated[str, StringConstraints(pattern=EVAL_DATASET_NAME_PATTERN)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class RecordedDatasetEval(BaseModel):
    """One dataset's score as an external evaluator reports it."""

    model_config = ConfigDict(extra="forbid")

    mean_reward: float = Field(allow_inf_nan=False, description="Mean reward over the episodes scored")
    pass_at_k: dict[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,2}$")], Probability] = Field(
        default_factory=dict, max_length=8, description="k -> pass@k in [0, 1]"
    )
    num_prompts: int = Field(ge=0, le=10_000_000)
    num_episodes: int = Field(ge=0, le=10_000_000)
    reasons: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=32, description="Episodes by how they ended (ok, agent_error, ...)"
    )


class RecordEvalRequest(BaseModel):
    """`POST /v1/jobs/{id}/evals`: the score of one weight version by an evaluator outside the job (a checkpoint
    of that version on an eval engine, or an external scorer reading published versions)."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=2**53, description="The weight version that was scored")
    evaluator: str = Field(
        pattern=contract.EVALUATOR_PATTERN,
        description="Who scored it (e.g. `checkpoint`); `engines` is the job's own rollout worker's name",
    )
    datasets: dict[DatasetName, RecordedDatasetEval] = Field(min_length=1, max_length=8)
    seen_unix_ms: int | None = Field(
        default=None,
        ge=0,
        description="When the evaluator got the version (e.g. the checkpoint was written); lag_s counts from it. "
        "Default: now (lag 0)",
    )

    @field_validator("evaluator")
    @classmethod
    def _not_the_engines(cls, evaluator: str) -> str:
        if evaluator == contract.ENGINES_EVALUATOR:
            raise ValueError(f"{evaluator!r} names the job's own rollout worker; an external evaluator takes another")
        return evaluator


def recorded_eval(body: RecordEvalRequest, *, now_ms: int) -> contract.VersionEval:
    seen_ms = now_ms if body.seen_unix_ms is None else min(body.seen_unix_ms, now_ms)
    datasets = {
        name: contract.DatasetEval(d.mean_reward, dict(d.pass_at_k), d.num_prompts, d.num_episodes, 0, dict(d.reasons))
        for name, d in body.datasets.items()
    }
    return contract.VersionEval(
        body.version, "scored", now_ms, seen_ms, (now_ms - seen_ms) / 1000, datasets, body.evaluator
    )


async def record_eval(redis: aioredis.Redis, job_id: str, body: RecordEvalRequest) -> contract.VersionEval:
    """Store an external evaluator's score of a version: it replaces a `missed` (the engines had left the version),
    never a score (EvalExistsError)."""
    result = recorded_eval(body, now_ms=int(time.time() * 1000))
    if not await _redis(contract.store_scored(redis, job_id, result)):
        raise EvalExistsError(
            f"job {job_id} already has a score for weight version {body.version} (one per version)",
            field="version",
        )
    return result


async def read_evals(redis: aioredis.Redis, job_id: str) -> list[contract.VersionEval]:
    return contract.parse_evals(await _redis(redis.hgetall(contract.evals_key(job_id))))


async def delete_evals(redis: aioredis.Redis, job_id: str) -> None:
    """Forget a deleted job's results, best effort (the job is gone already; a leftover hash is only memory).
    Claims expire by themselves."""
    try:
        await redis.delete(contract.evals_key(job_id), version_steps_key(job_id))
    except (RedisError, OSError) as exc:
        log.warning("could not delete a deleted job's evaluations", extra={"job_id": job_id, "error": str(exc)})


def eval_event(job_id: str, result: contract.VersionEval, step_times_ms: dict[int, int]) -> dict[str, Any]:
    """The `eval` event of a newly stored version (its datasets' mean reward and pass@k, and the lags)."""
    return {
        "type": "eval",
        "job_id": job_id,
        "version": result.version,
        "status": result.status,
        "evaluator": result.evaluator,
        "lag_s": result.lag_s,
        "step_to_score_s": step_to_score_s(result, step_times_ms),
        "datasets": {
            name: {"mean_reward": d.mean_reward, "pass_at_k": d.pass_at_k, "num_episodes": d.num_episodes}
            for name, d in result.datasets.items()
        },
    }


class EvalAnnouncer:
    """Which versions of one job this controller has announced already. Each observation costs one HLEN; the
    hash is read only when it holds a version not announced yet (fields are only ever added)."""

    def __init__(self) -> None:
        self.announced: set[int] = set()

    async def new_events(self, redis: aioredis.Redis, job_id: str) -> list[dict[str, Any]]:
        if await redis.hlen(contract.evals_key(job_id)) <= len(self.announced):
            return []
        fresh = [r for r in await read_evals(redis, job_id) if r.version not in self.announced]
        self.announced.update(r.version for r in fresh)
        step_times_ms = await read_version_steps(redis, job_id)
        return [eval_event(job_id, r, step_times_ms) for r in fresh]
