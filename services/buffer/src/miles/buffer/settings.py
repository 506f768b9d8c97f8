"""Settings of the buffer (environment prefix MILES_BUFFER_), validated at start-up.

Durability depends on how Redis persists, which this service cannot set for a shared Redis: run Redis with
`appendonly yes`. With `appendfsync everysec` (the default the chart configures) a Redis *host* crash may lose
the last second of acknowledged writes; with `appendfsync always` nothing acknowledged is lost, at the cost of
one fsync per write. A crash of the buffer process itself never loses or duplicates anything (every
transition is one Lua script). `redis_persistence_check` says what to do when Redis is not persisting.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, model_validator

from miles.common.auth import check_token_setting
from miles.common.settings import ServiceSettings, service_config

REQUEST_HEADROOM_BYTES = 8 * 1024 * 1024
"""Room above max_group_bytes for the rest of a request (job id, lease id lists of Ack/Nack ...)."""


class BufferSettings(ServiceSettings):
    """Every field is documented and mirrored in helm/miles/values.yaml."""

    model_config = service_config("BUFFER")

    port: int = 50051
    """gRPC listening port."""

    metrics_port: int = 51051
    """HTTP port for /healthz, /readyz and /metrics."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding every job's buffer (redis://[:password@]host:port/db); run it with appendonly yes (above)."""

    redis_max_connections: int = Field(default=64, ge=1)
    """Connections to Redis this process opens at most; calls beyond it wait for a free connection."""

    redis_socket_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds one Redis command may take before the call fails with UNAVAILABLE (retried by clients)."""

    redis_persistence_check: Literal["off", "warn", "require"] = "warn"
    """At start-up, read Redis's `appendonly` setting: `warn` logs when AOF is off, `require` refuses to start
    (for deployments that must survive a Redis restart), `off` skips the check (Redis that forbids CONFIG)."""

    key_prefix: str = "miles:buffer"
    """Prefix of every Redis key this service writes; per-job keys are `<prefix>:{<job_id>}:<what>`."""

    default_capacity_groups: int = Field(default=1024, ge=1)
    """Capacity (queued + leased groups) of a job configured with capacity_groups = 0."""

    push_wait_max_s: float = Field(default=30.0, ge=0)
    """Longest a PushGroup waits for room in a full job before RESOURCE_EXHAUSTED (also bounded by the call's
    deadline)."""

    pull_wait_max_s: float = Field(default=60.0, ge=0)
    """Longest a PullBatch long-polls, whatever its wait_s (also bounded by the call's deadline)."""

    poll_interval_s: float = Field(default=0.1, gt=0)
    """How often a waiting push or pull re-checks Redis for changes made by other buffer replicas (changes made
    by this process wake waiters at once)."""

    max_pull_groups: int = Field(default=4096, ge=1)
    """Largest num_groups one PullBatch may ask for."""

    max_pull_bytes: int = Field(default=128 * 1024 * 1024, ge=1)
    """A PullBatch returns fewer than num_groups groups rather than more than this many bytes of groups (at least
    one group is always returned); keep it under the gRPC message limit (256 MiB)."""

    max_lease_s: float = Field(default=86400.0, gt=0)
    """Longest lease (PullBatch lease_s, ExtendLease lease_s) a consumer may ask for, in seconds."""

    lease_reap_interval_s: float = Field(default=1.0, gt=0)
    """How often expired leases are returned to their queue (pulls also return them first); the delay between
    a lease's expiry and its group being pullable again is at most this."""

    dedupe_window_s: float = Field(default=86400.0, gt=0)
    """How long the id of a finished group (acked, dropped as stale, filtered, rejected, discarded) and the id
    of an acked lease are remembered, so that a retried push or ack within this window is a no-op. Queued and
    leased groups are always deduplicated."""

    dedupe_max_ids_per_job: int = Field(default=200_000, ge=1)
    """At most this many finished group ids (and as many acked lease ids) are remembered per job; the oldest
    are forgotten first (bounds Redis memory to roughly 100 bytes per id)."""

    max_group_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest serialized group accepted, in bytes. A push message larger than this (plus REQUEST_HEADROOM_BYTES)
    is refused by the gRPC layer with RESOURCE_EXHAUSTED before a byte of it is parsed; a group that fits the
    message but not this bound is refused with INVALID_ARGUMENT."""

    stats_refresh_interval_s: float = Field(default=5.0, gt=0)
    """How often the per-job gauges (queue size, leased, age of oldest group) are refreshed from Redis."""

    operator_token: SecretStr = SecretStr("")
    """Bearer token the job-control RPCs (ConfigureJob, DeleteJob) need; held by the controller. Required (32+
    characters) when host is not a loopback address; empty on loopback leaves them open (development). The data
    RPCs (push, pull, ack ...) stay open to the job's processes inside the chart's NetworkPolicies."""

    @model_validator(mode="after")
    def _check_operator_token(self) -> BufferSettings:
        check_token_setting(self.operator_token.get_secret_value(), host=self.host, field="operator_token")
        return self
