"""Settings of the controller (environment prefix MILES_CONTROLLER_), validated at start-up.

Auth rule: `api_tokens` are the bearer tokens `/v1/*` accepts. A controller bound to a non-loopback interface
refuses to start without one; on 127.0.0.1 / ::1 / localhost it may run without, and the job API is then open to
local callers (development only). /healthz, /readyz, /metrics and /openapi.json are always open.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from miles.common.auth import is_loopback_host
from miles.common.settings import ServiceSettings, service_config
from miles.controller.backends.base import PlatformTokens, SharedPool, SharedServices

MIN_API_TOKEN_CHARS = 16


class ControllerSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("CONTROLLER")

    port: int = 8080
    """HTTP listening port (job API, probes, metrics, /openapi.json)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding job records, event streams and idempotency keys (redis://[:password@]host:port/db)."""

    key_prefix: str = "miles:controller"
    """Prefix of every Redis key this service writes (`<prefix>:job:<id>`, `<prefix>:jobs`, ...)."""

    api_tokens: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    """Bearer tokens accepted by the job API, comma-separated (or a JSON list); compared in constant time.
    Empty: the API is open, allowed only on a loopback host."""

    backend: Literal["local", "kubernetes"] = "local"
    """Where per-job resources run: `local` (processes on this machine) or `kubernetes` (objects from the
    chart's job templates)."""

    state_dir: Path = Path(".miles/controller")
    """Local backend: directory of per-job work dirs and logs (`<state_dir>/jobs/<job_id>/`)."""

    local_options: dict[str, Any] = Field(default_factory=dict)
    """Local backend: extra keyword options of `LocalJobBackend` (see the controller README)."""

    router_url: str = "http://127.0.0.1:8082"
    """HTTP base URL of the rollout router (jobs' engines are its pool `<job_id>`; prefix hit rate from its
    `/admin/v1/stats`). "" = no router."""

    router_admin_address: str = ""
    """host:port of the router's gRPC admin API (local backend registers engines there); "" = use HTTP admin."""

    session_url: str = "http://127.0.0.1:8081"
    """HTTP base URL of the session server, where each job's config is registered. "" = do not register."""

    session_operator_token: SecretStr = SecretStr("")
    """Operator bearer token of the session server (job config registration)."""

    router_admin_token: SecretStr = SecretStr("")
    """Bearer token of the router's admin API (engine registration, drain, stats); also handed to every job's
    weight-sync and trainer. "" = the router's admin API is open (loopback only)."""

    buffer_operator_token: SecretStr = SecretStr("")
    """Bearer token of the buffer's job control (ConfigureJob, DeleteJob)."""

    engine_admin_api_key: SecretStr = SecretStr("")
    """Admin key of every job's engines (their control routes; SGLang `--admin-api-key`), handed to the job's
    engines, weight-sync and trainer."""

    engine_api_key: SecretStr = SecretStr("")
    """API key of every job's engines' generation routes (SGLang `--api-key`); "" = they stay open to the
    router (inside the engine pool's NetworkPolicy on Kubernetes)."""

    weightsync_auth_token: SecretStr = SecretStr("")
    """Bearer token of every job's weight-sync gRPC API, handed to the job's weight-sync and trainer."""

    trainer_auth_token: SecretStr = SecretStr("")
    """Bearer token of every job's trainer gRPC API (the controller reads Status and sends Stop with it)."""

    sandbox_operator_token: SecretStr = SecretStr("")
    """Operator token of the sandbox gateway; each job's rollout workers get a capability derived from it that
    opens only that job's sandboxes (miles.common.auth.job_capability)."""

    buffer_address: str = "127.0.0.1:50051"
    """host:port of the buffer's gRPC API (ConfigureJob before a job starts). "" = do not configure."""

    sandbox_address: str = "127.0.0.1:50054"
    """host:port of the sandbox gateway's gRPC API (handed to the jobs' rollout workers)."""

    sandbox_http_url: str = ""
    """HTTP base URL of the sandbox gateway ("" = none)."""

    shared_pools: list[SharedPool] = Field(default_factory=list)
    """Shared engine pools LoRA jobs may run on (`resources.engines.shared_pool`), a JSON list of objects with
    `name`, `model_path`, `replicas`, `max_loaded_loras`, `max_lora_rank`, `lora_target_modules`, `extra_args`.
    Local backend: it starts a pool's engines with the first job on it. Kubernetes: the chart sets it from
    `sharedPools`, which also deploys each pool's engines."""

    observe_interval_s: float = Field(default=2.0, gt=0)
    """How often the supervisor observes each active job (and looks for new ones), seconds."""

    start_timeout_s: float = Field(default=1800.0, gt=0)
    """A job whose resources are not running this long after submission FAILS, seconds."""

    max_start_attempts: int = Field(default=30, ge=1)
    """Consecutive failed `backend.start` calls (retryable errors) before the job FAILS."""

    max_observe_failures: int = Field(default=30, ge=1)
    """Consecutive failed `backend.observe` calls before the job FAILS."""

    stall_warning_s: float = Field(default=180.0, gt=0)
    """A RUNNING job that trains no step for this long (or for 4 of its recent step intervals, if longer: a big
    model's steps may take minutes) gets an error entry saying so, with its pools and the latest process problem;
    the next step emits a `resumed` event. The job is not failed for it: a stalled job may recover."""

    max_active_jobs: int = Field(default=16, ge=1)
    """Jobs PENDING, QUEUED or RUNNING at once; a submission beyond it gets 429."""

    max_events_per_job: int = Field(default=10000, ge=100)
    """Events kept in a job's stream (oldest trimmed first)."""

    idempotency_ttl_s: float = Field(default=86400.0, gt=0)
    """How long an `Idempotency-Key` is remembered, seconds."""

    leader_lease_s: float = Field(default=15.0, gt=0)
    """Supervisor leader lease in Redis: with several replicas only the holder supervises; a replica that died
    without releasing it is replaced after this long, seconds."""

    cancel_wait_s: float = Field(default=10.0, ge=0)
    """How long `POST /v1/jobs/{id}/cancel` waits for the job to reach CANCELLED before answering 202, seconds."""

    shared_call_timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of one call to a shared service (session server, buffer, router), seconds."""

    sse_keepalive_s: float = Field(default=15.0, gt=0)
    """Seconds between SSE keep-alive comments on an idle event stream."""

    kubernetes_namespace: str = ""
    """Kubernetes backend: namespace of per-job objects ("" = the controller pod's own namespace, else
    `default`)."""

    kubernetes_templates_config_map: str = "miles-job-templates"
    """Kubernetes backend: the chart's ConfigMap holding the per-job templates (`<fullname>-job-templates`)."""

    kubernetes_config: Literal["auto", "in_cluster", "kubeconfig"] = "auto"
    """Kubernetes backend: how the client authenticates (`auto`: in-cluster when running in a pod)."""

    kubernetes_kueue: bool = False
    """Kubernetes backend: jobs with a `kueue` block are admitted by Kueue (a Workload per job); the chart sets it
    from `kueue.enabled`. Off: such a job is refused at submission."""

    @field_validator("api_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: Any) -> Any:
        if isinstance(value, str):
            stripped = value.strip()
            if stripped.startswith("["):
                return json.loads(stripped)
            return [token.strip() for token in stripped.split(",") if token.strip()]
        return value

    @field_validator("shared_pools")
    @classmethod
    def _unique_pool_names(cls, value: list[SharedPool]) -> list[SharedPool]:
        names = [pool.name for pool in value]
        if len(set(names)) != len(names):
            raise ValueError(f"shared pool names must be unique (got {names})")
        return value

    @model_validator(mode="after")
    def _check_tokens(self) -> ControllerSettings:
        for token in self.api_tokens:
            if len(token.get_secret_value()) < MIN_API_TOKEN_CHARS:
                raise ValueError(f"every api token must have at least {MIN_API_TOKEN_CHARS} characters")
        if not self.api_tokens and not is_loopback_host(self.host):
            raise ValueError(
                f"api_tokens is required when host is {self.host!r} (not a loopback address): "
                "set MILES_CONTROLLER_API_TOKENS"
            )
        return self

    def shared_services(self) -> SharedServices:
        """The shared-service addresses handed to the backend."""
        return SharedServices(
            redis_url=self.redis_url,
            router_url=self.router_url,
            router_admin_address=self.router_admin_address,
            session_url=self.session_url,
            session_operator_token=self.session_operator_token.get_secret_value(),
            buffer_address=self.buffer_address,
            sandbox_address=self.sandbox_address,
            sandbox_http_url=self.sandbox_http_url,
            shared_pools=tuple(self.shared_pools),
            tokens=PlatformTokens(
                router_admin=self.router_admin_token.get_secret_value(),
                buffer_operator=self.buffer_operator_token.get_secret_value(),
                engine_admin_api_key=self.engine_admin_api_key.get_secret_value(),
                engine_api_key=self.engine_api_key.get_secret_value(),
                weightsync=self.weightsync_auth_token.get_secret_value(),
                trainer=self.trainer_auth_token.get_secret_value(),
                sandbox_operator=self.sandbox_operator_token.get_secret_value(),
            ),
        )
