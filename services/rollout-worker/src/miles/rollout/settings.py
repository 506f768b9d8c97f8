"""Settings of the rollout-worker (environment prefix MILES_ROLLOUT_), validated at start-up.

Process fields (where Redis, the session server, the buffer and the sandbox gateway are; who this worker is)
are top-level. The job's rollout section (`miles.common.jobspec.rollout.RolloutSpec`: dataset, agent, reward,
groups, concurrency) is the nested `rollout` field; the controller writes `{"job_id": ..., "rollout": {...}}`
into the JSON file named by `MILES_ROLLOUT_CONFIG_FILE`. Without a job the worker serves its probes and idles.
"""

from __future__ import annotations

import os
import socket
from typing import Self

from pydantic import Field, SecretStr, model_validator

from miles.common.jobspec.evaluation import EvaluationSpec
from miles.common.jobspec.rollout import RolloutSpec
from miles.common.settings import ServiceSettings, service_config


def _default_worker_id() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()


class RolloutSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("ROLLOUT")

    port: int = 8083
    """HTTP port: /healthz, /readyz, /metrics and /v1/status."""

    job_id: str = Field(default="", pattern=r"^[^\s{}/:]{0,200}$")
    """Job whose prompts this worker rolls out; empty: serve probes and idle."""

    worker_id: str = Field(default_factory=_default_worker_id, min_length=1, max_length=200)
    """Identity of this worker in prompt leases (default: the host name). A worker restarted with the same id
    takes its predecessor's leases back at once; another id waits for them to expire (`lease_s`)."""

    rollout: RolloutSpec | None = None
    """The job's rollout section (required when job_id is set)."""

    evaluation: EvaluationSpec | None = None
    """The job's evaluation section (`miles.common.jobspec.evaluation`), from the same config file."""

    evaluation_enabled: bool = True
    """This worker takes part in evaluating the job's weight versions when the job has an `evaluation` section
    (`miles.rollout.eval_loop`: each version goes to the one worker that claims it in Redis)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding the job's dataset cursor and prompt leases (AOF on in production)."""

    key_prefix: str = "miles:rollout"
    """Prefix of every Redis key of the cursor."""

    lease_s: float = Field(default=120.0, gt=0)
    """A claimed prompt stays this worker's for this long without a heartbeat (renewed every lease_s / 3);
    after that another worker regenerates it."""

    session_server_url: str = "http://127.0.0.1:8081"
    """Base URL of the session server."""

    session_operator_token: SecretStr = SecretStr("")
    """Operator token of the session server (creates sessions); empty when it runs without one (loopback)."""

    inference_pools: dict[str, str] = Field(default_factory=dict)
    """The job's inference pools (a judge, a teacher): pool name -> its session-server job config and router pool
    (`<job_id>--<name>`); reward functions open sessions on them (`miles.rollout.pools`). Set by the controller."""

    router_url: str = ""
    """Base URL of the rollout router (SGLang protocol), through which `teacher_pool` scores samples."""

    teacher_pool: str = ""
    """On-policy distillation: router pool of the job's teacher (`<job_id>--<name>`); every trainable sample gets
    the teacher's logprobs of its response tokens (`miles.rollout.teacher`). "" = no distillation. Set by the
    controller from `train.distillation`."""

    sync_batch_groups: int = Field(default=0, ge=0)
    """Groups admitted per weight version, the trainer's batch_size_groups (miles.rollout.barrier): with
    `admission_versions_ahead` 0 the barrier of `train.mode: sync` (no new group starts until the job's engines
    serve the next version), else async's staleness window. 0 = no admission (every group starts at once). Set by
    the controller."""

    admission_versions_ahead: int = Field(default=0, ge=0)
    """With `sync_batch_groups`: how many versions past the live one a group may be admitted for; 0 = the sync
    barrier, the trainer's max_staleness for async (a group is trained at most that many versions after the
    weights it starts with). Set by the controller."""

    sync_drop_equal_rewards: bool = False
    """With the barrier: groups whose trainable rewards are all equal (within each role) are not pushed and give
    their place back, because the trainer would discard them (dynamic sampling) and wait for a batch the barrier
    never completes. Set by the controller."""

    sync_pool: str = ""
    """Router pool whose engines' version the barrier waits on ("" = the job id, the job's own pool)."""

    session_request_timeout_s: float = Field(default=120.0, gt=0)
    """Timeout of one session-server call (create, samples, delete)."""

    retry_budget_s: float = Field(default=60.0, ge=0)
    """How long a session-server call is retried (exponential backoff) while the server is unreachable or
    answers 5xx/429, before the episode is ABORTED (session_unavailable / samples_unavailable)."""

    orphan_min_age_s: float = Field(default=120.0, gt=0)
    """After a session create whose reply may have been lost, sessions of the job that no episode recorded and
    that are older than this are deleted (allow for clock skew between this worker and the session server)."""

    buffer_address: str = "127.0.0.1:50051"
    """host:port of the buffer service."""

    push_wait_s: float = Field(default=10.0, ge=0)
    """How long one push may wait for room in a full buffer before the worker backs off and retries (new
    episodes are paused meanwhile)."""

    sandbox_address: str = ""
    """host:port of the sandbox gateway's gRPC API (the `unit_tests` verifier; handed to agents as
    `metadata["sandbox_address"]`); empty: no sandbox."""

    sandbox_http_url: str = ""
    """Base URL of the sandbox gateway's HTTP facade, handed to agents as `metadata["sandbox_url"]` (agents
    need no gRPC code); empty: none."""

    sandbox_token: SecretStr = SecretStr("")
    """The job's capability at the sandbox gateway (the controller mints it; it opens only this job's
    sandboxes), sent by the `unit_tests` verifier and handed to agents as `metadata["sandbox_token"]`."""

    environment_url: str = ""
    """URL of the job's environment server when something else runs it (on Kubernetes: the per-job
    environment-server Service); empty: this worker starts one itself as a subprocess (jobs with
    rollout.environment only)."""

    envs_dir: str = ".envs"
    """Where the environment servers' interpreters are (`<envs_dir>/<name>/bin/python`, built by `make envs`); a
    relative path resolves against the working directory, else against the repository of the installed
    miles-envserver (a development checkout)."""

    environment_health_interval_s: float = Field(default=2.0, gt=0)
    """Seconds between checks of the environment server's /healthz (and of its process, when local)."""

    environment_health_timeout_s: float = Field(default=5.0, gt=0)
    """A /healthz slower than this counts as a failed check."""

    environment_failures_to_restart: int = Field(default=3, ge=1)
    """Failed checks in a row after which a local environment server is killed and restarted (a hung one)."""

    requeue_poll_interval_s: float = Field(default=5.0, gt=0)
    """How often the buffer is asked for prompts to regenerate (groups requeued as stale)."""

    @model_validator(mode="after")
    def _job_needs_section(self) -> Self:
        if self.job_id and self.rollout is None:
            raise ValueError("a job_id needs its rollout section (`rollout` in MILES_ROLLOUT_CONFIG_FILE)")
        if self.sync_batch_groups and not self.router_url:
            raise ValueError("sync_batch_groups needs router_url (the barrier reads the engines' version there)")
        if self.teacher_pool and not self.router_url:
            raise ValueError("teacher_pool needs router_url (the teacher is scored through the rollout router)")
        return self
