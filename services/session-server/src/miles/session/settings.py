"""Settings of the session-server (environment prefix MILES_SESSION_), validated at start-up.

Operator token rule (miles.common.auth.check_token_setting): a server bound to a non-loopback interface refuses to
start without an `operator_token` (32+ characters). On 127.0.0.1 / ::1 / localhost it may run without one; operator
endpoints (job configs, listing, creating and deleting any session) are then open to local callers, which is meant
for development only. Per-session capability tokens are always enforced.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from miles.common.auth import check_token_setting
from miles.common.settings import ServiceSettings, service_config


class SessionSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("SESSION")

    port: int = 8081
    """HTTP listening port."""

    store_backend: Literal["redis", "memory"] = "redis"
    """Where sessions live: `redis` (shared by every replica, survives restarts) or `memory` (one process only;
    tests and single-process demos)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding sessions and job model configs (redis://[:password@]host:port/db)."""

    redis_max_connections: int = Field(default=256, ge=1)
    """Connections to Redis this process opens at most."""

    redis_socket_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds one Redis command may take before the request fails with 503."""

    key_prefix: str = "miles:session"
    """Prefix of every Redis key this service writes; per-session keys are `<prefix>:s:{<session_id>}...`."""

    upstream_url: str = "http://127.0.0.1:8082"
    """Base URL of the rollout router (or, in tests, one engine) whose SGLang-native `/generate` is called."""

    upstream_timeout_s: float = Field(default=600.0, gt=0)
    """Longest one upstream generation may take (read timeout), seconds."""

    upstream_connect_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds to open a connection to the upstream before the turn fails with 503."""

    upstream_max_connections: int = Field(default=1024, ge=1)
    """Concurrent upstream connections this process opens at most."""

    upstream_retry_after_s: float = Field(default=2.0, gt=0)
    """Retry-After sent with a 503 when the upstream is unreachable or aborted the generation."""

    adapter_wait_s: float = Field(default=60.0, gt=0)
    """How long a turn of a LoRA job (job config lora_adapter) waits for the job's first live adapter version
    before a 503 adapter_not_published; the trainer publishes one before the job's first rollouts."""

    operator_token: SecretStr = SecretStr("")
    """Bearer token of operators and of the platform itself (controller, rollout workers): registers job configs,
    creates, lists and deletes sessions. 32+ characters; required unless `host` is a loopback address."""

    public_base_url: str | None = None
    """What `base_url` in a created session starts with (e.g. http://miles-session-server.miles:8081); unset: the
    scheme and host the create request arrived on."""

    default_ttl_s: float = Field(default=3600.0, gt=0)
    """A session expires after this many seconds without a recorded turn, unless created with its own ttl_s."""

    max_ttl_s: float = Field(default=7 * 86400.0, gt=0)
    """Largest ttl_s a session may ask for."""

    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Largest request body accepted, in bytes (413 above it)."""

    max_messages: int = Field(default=4096, ge=1)
    """Most messages one chat completion request may carry."""

    max_tree_nodes: int = Field(default=1024, ge=1)
    """Most model calls a tree session records (its nodes); a turn past it is a 409 session_tree_full."""

    max_tree_tokens: int = Field(default=4 * 1024 * 1024, ge=1)
    """Most token ids a tree session stores over all its nodes (a shared prefix counts once): 16 MiB in the
    store; a turn that could pass it (its new prompt ids plus max_tokens) is a 409 session_tree_full before the
    engine runs (or, when concurrent branches crossed it, not recorded)."""

    lock_ttl_s: float = Field(default=30.0, gt=0)
    """Lease of the per-session lock; a crashed holder's lock frees itself after this. Commits are fenced by the
    session's version counter, so an expired lease never corrupts a session."""

    lock_wait_s: float = Field(default=10.0, gt=0)
    """How long a request waits for the per-session lock before a 503 with Retry-After."""

    default_model_path: str | None = None
    """Model directory (Hugging Face layout: tokenizer.json, tokenizer_config.json with chat_template) used by
    sessions without a job_id, and by jobs whose config was never registered. Unset: such sessions are refused."""

    default_model_family: str = "default"
    """TITO family of the default model (`miles-tito families` lists them)."""

    default_engine_pool: str = "default"
    """Engine pool (X-Miles-Pool header) of sessions using the default model."""

    default_max_context_tokens: int | None = Field(default=None, ge=2)
    """Context length of the default model; unset: config.json's max_position_embeddings when present."""

    model_cache_size: int = Field(default=16, ge=1)
    """Tokenizers (per model path) and TITO tokenizers (per path, family and template kwargs) kept in memory."""

    reap_interval_s: float = Field(default=10.0, gt=0)
    """How often the live-session gauge is refreshed and expired sessions are counted."""

    export_processes: int = Field(default=1, ge=0)
    """Helper processes that build long sessions' GET and samples answers (exports.py), each one answer at a
    time; 0: every answer is built in the serving process. Built in process, a ~100 MB answer made turn p99 4-10x
    its idle p99 during the GET; in a helper, ~1.1x. Used with the redis store only."""

    export_min_tokens: int = Field(default=262_144, ge=0)
    """A linear session with at least this many token ids is answered by an export process; a shorter one in
    process (its answer's few MB do not stall turns, and it skips the helper's hop)."""

    @model_validator(mode="after")
    def _check_operator_token(self) -> SessionSettings:
        check_token_setting(self.operator_token.get_secret_value(), host=self.host, field="operator_token")
        if self.default_ttl_s > self.max_ttl_s:
            raise ValueError("default_ttl_s must not exceed max_ttl_s")
        return self
