"""Bodies of the job API (pydantic; their JSON schemas are published in /openapi.json)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from miles.common.jobspec.job import JobSpec
from miles.controller.health import job_health, policy_reward
from miles.controller.jobs import JobRecord, JobState


class PoolView(BaseModel):
    """One per-job pool: the size asked for and the replicas the backend last saw live."""

    desired: int
    live: int | None = None


class HealthView(BaseModel):
    """Training health (miles.controller.health): the reward trend, the statistics that announce a collapse, and
    what looks wrong."""

    reward_first: float | None = Field(default=None, description="Mean reward of the first 3 observed steps")
    reward_last: float | None = Field(default=None, description="Mean reward of the last 3 observed steps")
    entropy: float | None = Field(default=None, description="Policy entropy on its sampled tokens, last step")
    grad_norm: float | None = Field(default=None, description="Gradient norm before clipping, last step")
    logprob_diff: float | None = Field(default=None, description="Mean |train - rollout| logprob, last step")
    zero_signal_fraction: float | None = Field(
        default=None, description="Share of the groups pulled for the last step whose rewards were all equal"
    )
    clip_fraction: float | None = Field(default=None, description="Share of tokens the PPO clip acted on, last step")
    warnings: list[str] = Field(default_factory=list, description="What looks wrong (empty: healthy)")


class JobView(BaseModel):
    """A job as `GET /v1/jobs/{id}` shows it."""

    job_id: str
    name: str
    state: JobState
    created_at_s: float
    updated_at_s: float
    started_at_s: float | None = None
    ended_at_s: float | None = None
    cancel_requested: bool = False
    step: int = Field(description="Optimizer steps the trainer completed")
    num_steps: int = Field(description="Steps after which the job succeeds (train.num_steps)")
    weight_version: int = Field(description="Latest weight version the trainer published")
    reward: float | None = Field(
        default=None, description="Mean reward of the policy at the trainer's last step (every valid group pulled)"
    )
    staleness: float | None = Field(default=None, description="Mean staleness (versions) of the last step's groups")
    prefix_hit_rate: float | None = Field(default=None, description="Cached / prompt tokens of the job's engines")
    tito_mismatches: float | None = Field(
        default=None, description="Episodes whose token buffer differed critically from a fresh render (TITO)"
    )
    errors: list[str] = Field(description="Latest problems, newest last")
    pools: dict[str, PoolView] = Field(
        description="engines, rollout_workers, trainer, and inference_engines (all engines of the job's judge / "
        "teacher pools) when the spec has inference_pools"
    )
    metrics: dict[str, float] = Field(description="Every per-job metric the controller read (trainer, router)")
    health: HealthView = Field(description="Reward trend and collapse indicators")
    spec: JobSpec

    @classmethod
    def of(cls, record: JobRecord) -> JobView:
        resources = record.spec.resources
        desired = {
            "engines": resources.engines.replicas,
            "rollout_workers": resources.rollout_workers.replicas,
            "trainer": resources.trainer.replicas,
        }
        if record.spec.inference_pools:
            desired["inference_engines"] = sum(pool.replicas for pool in record.spec.inference_pools)
        metrics = record.metrics
        return cls(
            job_id=record.job_id,
            name=record.spec.name,
            state=record.state,
            created_at_s=record.created_at_s,
            updated_at_s=record.updated_at_s,
            started_at_s=record.started_at_s,
            ended_at_s=record.ended_at_s,
            cancel_requested=record.cancel_requested,
            step=record.step,
            num_steps=record.spec.train.num_steps,
            weight_version=record.weight_version,
            reward=policy_reward(metrics),
            staleness=metrics.get("staleness_mean"),
            prefix_hit_rate=metrics.get("prefix_hit_rate"),
            tito_mismatches=metrics.get("tito_critical_episodes"),
            errors=record.errors,
            pools={name: PoolView(desired=size, live=record.pools.get(name)) for name, size in desired.items()},
            metrics=metrics,
            health=HealthView(**asdict(job_health(metrics, record.rewards))),
            spec=record.spec,
        )


class JobList(BaseModel):
    jobs: list[JobView]


class ResizeRequest(BaseModel):
    """`PATCH /v1/jobs/{id}`: new pool sizes of a PENDING or RUNNING job (a Kueue job: 400) (absent: unchanged)."""

    model_config = ConfigDict(
        extra="forbid",
        # What `_something_to_change` checks, stated in the schema: at least one of the two, as a number.
        json_schema_extra={
            "anyOf": [
                {"required": ["engines"], "properties": {"engines": {"type": "integer"}}},
                {"required": ["rollout_workers"], "properties": {"rollout_workers": {"type": "integer"}}},
            ]
        },
    )

    engines: int | None = Field(default=None, ge=1, le=64, description="Engine replicas (1..64)")
    rollout_workers: int | None = Field(default=None, ge=1, le=256, description="Rollout-worker replicas (1..256)")

    @model_validator(mode="after")
    def _something_to_change(self) -> Self:
        if self.engines is None and self.rollout_workers is None:
            raise ValueError("give engines and/or rollout_workers")
        return self
