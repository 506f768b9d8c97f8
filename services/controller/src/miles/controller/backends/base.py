"""The interface between the controller's job supervisor and a backend that runs a job's per-job resources.

The controller owns the job record, its state machine and the registration of the job with the shared
services; a backend owns only the per-job processes or objects (engine pool with its weight-sync, rollout
workers, trainer). Every method may be called again after a controller restart: `start` adopts what already
runs instead of starting a second copy, and `stop` is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from miles.common.auth import SANDBOX_CAPABILITY, job_capability
from miles.common.jobspec.job import NODE_POOL_PATTERN, JobSpec

JobPhase = Literal["queued", "starting", "running", "succeeded", "failed"]
"""What a backend observes of a job: `queued` (waiting for a queue's admission, or preempted by it: resources
suspended; `error` says why), `starting` (resources being created or not ready yet), `running`, `succeeded` (the
trainer reported its last step), `failed` (a resource failed for good; see `error`)."""


@dataclass(frozen=True)
class PlatformTokens:
    """Bearer tokens of the platform's control APIs (miles.common.auth); "" = that API is open (loopback only).

    The controller calls the router admin API, the buffer's job control and the trainers with them, and hands
    each per-job process the ones it calls with (or, for engines, weight-sync and trainers, the one it checks).
    """

    router_admin: str = ""
    """The router's admin API (`/admin/v1/*`, RouterAdminService)."""
    buffer_operator: str = ""
    """The buffer's ConfigureJob / DeleteJob."""
    engine_admin_api_key: str = ""
    """The engines' control routes (pause, weight updates, cache flush ...; SGLang's `--admin-api-key`)."""
    engine_api_key: str = ""
    """The engines' generation routes (SGLang's `--api-key`); "" = open inside the pool's NetworkPolicy."""
    weightsync: str = ""
    """Every job's weight-sync gRPC API."""
    trainer: str = ""
    """Every job's trainer gRPC API (Status, Checkpoint, Stop, WatchEvents)."""
    sandbox_operator: str = ""
    """The sandbox gateway's operator token; each job gets `sandbox_job(job_id)`, which opens only its own
    sandboxes."""

    def sandbox_job(self, job_id: str) -> str:
        """The job's capability at the sandbox gateway ("" when the gateway is open)."""
        return job_capability(self.sandbox_operator, SANDBOX_CAPABILITY, job_id) if self.sandbox_operator else ""


LORA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class SharedPool(BaseModel):
    """A shared engine pool: engines of one base model serving the LoRA adapters of every job placed on it (a job
    names it in `resources.engines.shared_pool`). Its engines are the platform's, not a job's: they start once
    (the local backend starts them with the first job on the pool; on Kubernetes the chart's `sharedPools` deploys
    them, with an adapter volume every trainer mounts), join the
    router pool of this name, and outlive the jobs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    name: str = Field(pattern=NODE_POOL_PATTERN)
    """Pool name: the router pool of its engines and what a job spec names (a DNS label)."""

    model_path: str = Field(min_length=1)
    """The base model every engine serves; a job on the pool must name exactly this `model.path`."""

    replicas: int = Field(default=1, ge=1, le=64)
    """Engines of the pool."""

    max_loaded_loras: int = Field(default=8, ge=1)
    """Adapters resident per engine (`--max-loaded-loras`); each job keeps its newest 2 versions loaded, so a pool
    takes max_loaded_loras // 2 jobs at once."""

    max_lora_rank: int = Field(default=64, ge=1)
    """Highest adapter rank the engines accept (`--max-lora-rank`); a job with a higher `train.lora.rank` is 400."""

    lora_target_modules: list[str] = Field(default_factory=lambda: list(LORA_LINEAR_MODULES), min_length=1)
    """Modules adapters may target (`--lora-target-modules`); a job targeting another is 400."""

    extra_args: list[str] = Field(default_factory=list)
    """Arguments appended to every engine's command line (local backend), e.g. `--deterministic`."""

    def engine_args(self) -> list[str]:
        """The LoRA flags of the pool's engines (SGLang's names)."""
        return [
            "--enable-lora",
            "--max-loaded-loras",
            str(self.max_loaded_loras),
            "--max-loras-per-batch",
            str(self.max_loaded_loras),
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--lora-target-modules",
            *self.lora_target_modules,
        ]


@dataclass(frozen=True)
class SharedServices:
    """Where the shared, multi-tenant services are (from the controller's settings)."""

    redis_url: str
    """Redis URL (jobs, sessions, buffer, dataset cursors)."""
    router_url: str
    """HTTP base URL of the rollout router (SGLang protocol)."""
    router_admin_address: str
    """host:port of the router's gRPC admin API; "" = none (Kubernetes: the router discovers pods by label)."""
    session_url: str
    """HTTP base URL of the session server."""
    session_operator_token: str
    """Bearer token of the session server's operator API (job configuration)."""
    buffer_address: str
    """host:port of the buffer's gRPC API."""
    sandbox_address: str
    """host:port of the sandbox gateway's gRPC API."""
    sandbox_http_url: str
    """HTTP base URL of the sandbox gateway ("" = none)."""
    tokens: PlatformTokens = field(default_factory=PlatformTokens)
    """Bearer tokens of the control APIs."""
    shared_pools: tuple[SharedPool, ...] = ()
    """The shared engine pools LoRA jobs may run on."""

    def shared_pool(self, name: str) -> SharedPool | None:
        return next((pool for pool in self.shared_pools if pool.name == name), None)


@dataclass(frozen=True)
class JobProgress:
    """What a backend observes of a running job (every field optional but `phase`)."""

    phase: JobPhase
    step: int = 0
    """Optimizer steps the trainer has completed."""
    weight_version: int = 0
    """Latest weight version the trainer published."""
    error: str = ""
    """Why the job failed (phase `failed`), or the latest recoverable problem (e.g. a restarted process)."""
    step_finished_unix_ms: int = 0
    """When the step that produced `weight_version` finished (the trainer's Status; 0 when unknown): evaluation
    scores count their step-to-score time from it."""
    pools: dict[str, int] = field(default_factory=dict)
    """Live replicas per pool: `engines`, `rollout_workers`, `trainer`, and `inference_engines` (ready engines of
    the job's inference pools, all together) when it has any."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Job metrics the backend can read (added to the job record as they are): the trainer's
    `Status.last_step_metrics` as they are (`reward_mean`, `staleness_mean`, `staleness_max`,
    `tokens_per_second` ...), and `tito_critical_episodes` summed over the rollout workers'
    `miles_rollout_tito_critical_episodes_total`. Missing keys are simply not shown."""


class JobBackend(Protocol):
    """Runs the per-job resources of jobs. Every method is safe to call again after a controller restart."""

    name: str
    """`local` or `kubernetes`."""

    async def check_spec(self, spec: JobSpec) -> None:
        """Raise InvalidArgumentError when this backend cannot run `spec` (called at submission, so the caller gets
        a 400 and nothing is stored); facts it cannot read now are left for `start` to report."""
        ...

    async def start(self, job_id: str, spec: JobSpec, *, record_routing: bool | None = None) -> None:
        """Create the job's per-job resources; idempotent: adopts what already runs for `job_id`.

        `record_routing`: whether the session server records the job's MoE routing, as it answered the job's
        registration (None: unknown); the engines answer routed experts accordingly when the controller cannot
        read the model itself (`routing_replay.engines_record_routing`)."""
        ...

    async def observe(self, job_id: str, spec: JobSpec) -> JobProgress:
        """The job's current progress (called every `observe_interval_s` by the supervisor)."""
        ...

    async def resize(self, job_id: str, spec: JobSpec, *, engines: int | None, rollout_workers: int | None) -> None:
        """Change the engine and/or rollout-worker pool size (None: leave as is) of a running job."""
        ...

    async def stop(self, job_id: str) -> None:
        """Remove every per-job process or object of `job_id`; idempotent (nothing to remove is fine)."""
        ...

    async def close(self) -> None:
        """Release the backend's own connections (per-job resources keep running)."""
        ...


def sync_batch_groups(spec: JobSpec) -> int:
    """Groups the rollout workers admit per version of the job's own engines (miles.rollout.barrier): the barrier
    of train.mode sync, the staleness window of async. A job on a shared LoRA pool has no engine version of its
    own to wait on: no admission (the trainer still bounds staleness)."""
    if spec.resources.engines.shared_pool is not None:
        return 0
    return spec.train.batch_size_groups


def barrier_settings(spec: JobSpec) -> dict[str, int | bool]:
    """The rollout workers' admission settings: groups per version, how many versions past the live one a group
    may be admitted for (0: the sync barrier; async: max_staleness), and whether equal-reward groups do not count
    (the trainer discards them under dynamic sampling, so the batch needs others in their place)."""
    groups = sync_batch_groups(spec)
    return {
        "sync_batch_groups": groups,
        "admission_versions_ahead": spec.train.effective_max_staleness if groups else 0,
        "sync_drop_equal_rewards": bool(groups) and spec.train.discards_zero_signal,
    }
