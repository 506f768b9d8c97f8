"""Read-only views of engines and pools, shared by the admin API (HTTP and gRPC) and the metrics collector."""

from __future__ import annotations

from dataclasses import dataclass

from miles.router.engine import EngineSource, EngineState


@dataclass(frozen=True)
class EngineSnapshot:
    pool: str
    url: str
    state: EngineState
    source: EngineSource
    weight_version: int | None
    in_flight: int
    queued: int
    queued_tokens: int
    max_concurrency: int
    num_sticky_keys: int
    circuit_open: bool
    kv_capacity_tokens: int | None
    cache_tree_tokens: int
    paused: bool = False
    """The generation check found the engine paused (its `state` then reads unhealthy)."""
    admit_at_version: int | None = None
    """Joining: no requests until it reports this weight version (its `state` reads unhealthy meanwhile)."""


@dataclass(frozen=True)
class PoolStatsSnapshot:
    pool: str
    policy: str
    requests_total: int
    retries_total: int
    failures_total: int
    sticky_hits_total: int
    sticky_misses_total: int
    sticky_new_keys_total: int
    backpressure_total: int
    version_conflicts_total: int
    prompt_tokens_total: int
    cached_tokens_total: int
    num_engines: int
    num_healthy_engines: int

    @property
    def prefix_hit_rate(self) -> float:
        """cached / prompt tokens reported by the engines (0 without traffic)."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
