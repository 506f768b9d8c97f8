"""The router's Prometheus metrics (`miles_router_*`) and the per-pool counters behind the Stats call.

Counters are incremented as requests go; per-engine gauges (in flight, queue depth, health, weight version, sticky
keys, tree size) are read from the registry at scrape time by `EngineCollector`, so a removed engine's series
disappear with it; so are the per-pool gauges (engines, prefix hit ratio, and the saturation ratio the engine
pool's autoscaler scales on). Labels are bounded: pool (one per job), policy (4 values), route (3), reason/branch
(fixed sets) and engine (bounded by the registry).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from miles.common.contracts.weight_version import UNKNOWN_WEIGHT_VERSION
from miles.common.telemetry import LATENCY_BUCKETS_S, Metrics
from miles.router.engine import EngineState
from miles.router.policies import StickyOutcome
from miles.router.snapshots import EngineSnapshot, PoolStatsSnapshot

FAILURE_REASONS = (
    "no_engine",
    "version_conflict",
    "backpressure",
    "engine_unreachable",
    "engine_error",
    "stream_broken",
    "invalid_input",
)
ENGINE_OUTCOMES = ("ok", "client_error", "server_error", "connect_error", "broken")
POOL_SATURATION_METRIC = "pool_saturation_ratio"
"""`miles_router_pool_saturation_ratio{pool}`: what the chart's per-job engine HPA scales on (`pool_saturation`)."""


class RouterMetrics:
    """Every counter and histogram of the router, created once per process."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.requests = metrics.counter("requests", "Data-plane requests routed", ["pool", "policy", "route"])
        self.retries = metrics.counter("retries", "Extra attempts on another engine", ["pool", "policy"])
        self.failures = metrics.counter(
            "failures", "Requests that ended in an error, by reason", ["pool", "policy", "reason"]
        )
        self.sticky_hits = metrics.counter(
            "sticky_hits", "Requests sent to their key's sticky engine", ["pool", "policy"]
        )
        self.sticky_misses = metrics.counter(
            "sticky_misses", "Requests whose key had to move off its sticky engine", ["pool", "policy"]
        )
        self.sticky_new_keys = metrics.counter(
            "sticky_new_keys", "Requests whose routing key was new (placed)", ["pool", "policy"]
        )
        self.decisions = metrics.counter(
            "routing_decisions", "Engine choices by the rule that decided", ["pool", "policy", "branch"]
        )
        self.prompt_tokens = metrics.counter(
            "prompt_tokens", "Prompt tokens reported by engines (meta_info.prompt_tokens)", ["pool", "policy"]
        )
        self.cached_tokens = metrics.counter(
            "cached_tokens",
            "Prompt tokens served from engine prefix caches (meta_info.cached_tokens)",
            ["pool", "policy"],
        )
        self.engine_requests = metrics.counter(
            "engine_requests", "Attempts sent to an engine, by outcome", ["pool", "engine", "outcome"]
        )
        self.queue_wait_s = metrics.histogram(
            "queue_wait_seconds", "Time a request waited in an engine queue, seconds", ["pool"], LATENCY_BUCKETS_S
        )
        self.upstream_latency_s = metrics.histogram(
            "upstream_headers_seconds", "Time from sending to an engine to its response headers, seconds", ["pool"]
        )

    def for_pool(self, pool: str, policy: str) -> PoolCounters:
        return PoolCounters(self, pool, policy)

    def forget_engine(self, pool: str, url: str) -> None:
        for outcome in ENGINE_OUTCOMES:
            remove_labels(self.engine_requests, pool, url, outcome)


@dataclass
class PoolCounters:
    """A pool's counters: plain integers (for Stats) mirrored into Prometheus."""

    metrics: RouterMetrics
    pool: str
    policy: str
    requests_total: int = 0
    retries_total: int = 0
    failures_total: int = 0
    sticky_hits_total: int = 0
    sticky_misses_total: int = 0
    sticky_new_keys_total: int = 0
    backpressure_total: int = 0
    version_conflicts_total: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0

    def request(self, route: str) -> None:
        self.requests_total += 1
        self.metrics.requests.labels(self.pool, self.policy, route).inc()

    def retry(self) -> None:
        self.retries_total += 1
        self.metrics.retries.labels(self.pool, self.policy).inc()

    def failure(self, reason: str) -> None:
        self.failures_total += 1
        if reason == "backpressure":
            self.backpressure_total += 1
        elif reason == "version_conflict":
            self.version_conflicts_total += 1
        self.metrics.failures.labels(self.pool, self.policy, reason).inc()

    def decision(self, branch: str) -> None:
        self.metrics.decisions.labels(self.pool, self.policy, branch).inc()

    def sticky(self, sticky: StickyOutcome | None) -> None:
        """The sticky outcome of one request (counted once, however many attempts)."""
        if sticky is StickyOutcome.HIT:
            self.sticky_hits_total += 1
            self.metrics.sticky_hits.labels(self.pool, self.policy).inc()
        elif sticky is StickyOutcome.MISS:
            self.sticky_misses_total += 1
            self.metrics.sticky_misses.labels(self.pool, self.policy).inc()
        elif sticky is StickyOutcome.NEW:
            self.sticky_new_keys_total += 1
            self.metrics.sticky_new_keys.labels(self.pool, self.policy).inc()

    def tokens(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prompt_tokens_total += num_prompt_tokens
        self.cached_tokens_total += num_cached_tokens
        self.metrics.prompt_tokens.labels(self.pool, self.policy).inc(num_prompt_tokens)
        self.metrics.cached_tokens.labels(self.pool, self.policy).inc(num_cached_tokens)

    def engine_attempt(self, url: str, outcome: str) -> None:
        self.metrics.engine_requests.labels(self.pool, url, outcome).inc()

    def queue_wait(self, wait_s: float) -> None:
        self.metrics.queue_wait_s.labels(self.pool).observe(wait_s)

    def upstream_headers(self, latency_s: float) -> None:
        self.metrics.upstream_latency_s.labels(self.pool).observe(latency_s)


class EngineCollector(Collector):
    """Per-engine and per-pool gauges, computed from the live registry at scrape time."""

    def __init__(
        self,
        metrics: Metrics,
        engines: Callable[[], Sequence[EngineSnapshot]],
        pools: Callable[[], Sequence[PoolStatsSnapshot]],
    ) -> None:
        self._name = metrics.full_name
        self._engines = engines
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        engines = self._engines()
        labels = ["pool", "engine"]
        yield from self._engine_gauges(engines, labels)
        hit_rate = GaugeMetricFamily(
            self._name("prefix_hit_ratio"), "cached / prompt tokens since start, per pool", labels=["pool", "policy"]
        )
        num_engines = GaugeMetricFamily(self._name("pool_engines"), "Engines registered per pool", labels=["pool"])
        saturation = GaugeMetricFamily(
            self._name(POOL_SATURATION_METRIC),
            "Requests in flight or queued over the concurrency slots of the pool's engines, at this router replica "
            "(0 without engines); above 1 requests wait in the router's queues",
            labels=["pool"],
        )
        ratios = pool_saturation(engines)
        for stats in self._pools():
            hit_rate.add_metric([stats.pool, stats.policy], stats.prefix_hit_rate)
            num_engines.add_metric([stats.pool], stats.num_engines)
            saturation.add_metric([stats.pool], ratios.get(stats.pool, 0.0))
        yield hit_rate
        yield num_engines
        yield saturation

    def _engine_gauges(self, engines: Iterable[EngineSnapshot], labels: list[str]) -> Iterator[Metric]:
        families = {
            "in_flight": GaugeMetricFamily(
                self._name("engine_in_flight_requests"), "Requests in flight per engine", labels=labels
            ),
            "queued": GaugeMetricFamily(
                self._name("engine_queue_depth_requests"), "Requests queued in front of an engine", labels=labels
            ),
            "queued_tokens": GaugeMetricFamily(
                self._name("engine_queued_tokens"), "Estimated prompt tokens queued per engine", labels=labels
            ),
            "healthy": GaugeMetricFamily(
                self._name("engine_healthy"),
                "1 when the engine takes requests (healthy, not paused, breaker closed)",
                labels=labels,
            ),
            "paused": GaugeMetricFamily(
                self._name("engine_paused"),
                "1 while the generation check finds the engine paused (it answers /health but holds requests)",
                labels=labels,
            ),
            "draining": GaugeMetricFamily(self._name("engine_draining"), "1 while draining or drained", labels=labels),
            "version": GaugeMetricFamily(
                self._name("engine_weight_version"), "Weight version last reported (-1 unknown)", labels=labels
            ),
            "sticky": GaugeMetricFamily(
                self._name("engine_sticky_keys"), "Routing keys sticky per engine", labels=labels
            ),
            "tree": GaugeMetricFamily(
                self._name("engine_cache_tree_tokens"), "Tokens the prefix tree attributes to an engine", labels=labels
            ),
        }
        for engine in engines:
            values = [engine.pool, engine.url]
            families["in_flight"].add_metric(values, engine.in_flight)
            families["queued"].add_metric(values, engine.queued)
            families["queued_tokens"].add_metric(values, engine.queued_tokens)
            families["healthy"].add_metric(values, 1.0 if engine.state is EngineState.HEALTHY else 0.0)
            families["paused"].add_metric(values, 1.0 if engine.paused else 0.0)
            draining = engine.state in (EngineState.DRAINING, EngineState.DRAINED)
            families["draining"].add_metric(values, 1.0 if draining else 0.0)
            version = engine.weight_version
            families["version"].add_metric(values, float(UNKNOWN_WEIGHT_VERSION if version is None else version))
            families["sticky"].add_metric(values, engine.num_sticky_keys)
            families["tree"].add_metric(values, engine.cache_tree_tokens)
        yield from families.values()


def pool_saturation(engines: Iterable[EngineSnapshot]) -> dict[str, float]:
    """Per pool: requests in flight plus queued over the concurrency slots of its registered engines (draining,
    paused or unhealthy ones included, so that a weight update's pause does not read as lost capacity). The signal
    of the engine pool's autoscaler (docs/operations.md): at 1 every slot is taken; above it requests wait here."""
    load: dict[str, int] = {}
    slots: dict[str, int] = {}
    for engine in engines:
        load[engine.pool] = load.get(engine.pool, 0) + engine.in_flight + engine.queued
        slots[engine.pool] = slots.get(engine.pool, 0) + engine.max_concurrency
    return {pool: load[pool] / slots[pool] if slots[pool] else 0.0 for pool in load}


def remove_labels(counter: Counter | Histogram, *labels: str) -> None:
    """Drop one label combination if it exists (prometheus_client raises KeyError otherwise)."""
    with contextlib.suppress(KeyError):
        counter.remove(*labels)
