"""The per-pool saturation ratio: the signal of the chart's per-job engine HPA (docs/operations.md)."""

from __future__ import annotations

import dataclasses

from miles.common.telemetry import Metrics
from miles.router.engine import EngineSource, EngineState
from miles.router.metrics import EngineCollector, pool_saturation
from miles.router.snapshots import EngineSnapshot, PoolStatsSnapshot

_ENGINE = EngineSnapshot(
    pool="job-a",
    url="http://10.0.0.1:30000",
    state=EngineState.HEALTHY,
    source=EngineSource.KUBERNETES,
    weight_version=3,
    in_flight=0,
    queued=0,
    queued_tokens=0,
    max_concurrency=64,
    num_sticky_keys=0,
    circuit_open=False,
    kv_capacity_tokens=None,
    cache_tree_tokens=0,
)


def _engine(
    pool: str, url: str, in_flight: int, queued: int, max_concurrency: int = 64, **kw: object
) -> EngineSnapshot:
    return dataclasses.replace(
        _ENGINE, pool=pool, url=url, in_flight=in_flight, queued=queued, max_concurrency=max_concurrency, **kw
    )


def _pool(pool: str, num_engines: int) -> PoolStatsSnapshot:
    return PoolStatsSnapshot(pool, "session_affinity", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, num_engines, num_engines)


def test_pool_saturation_is_in_flight_plus_queued_over_the_slots_of_every_registered_engine() -> None:
    engines = [
        _engine("job-a", "http://a1", in_flight=64, queued=32),
        # Paused for a weight update: its slots still count, so a pause does not read as lost capacity.
        _engine("job-a", "http://a2", in_flight=64, queued=0, state=EngineState.DRAINING, paused=True),
        _engine("job-b", "http://b1", in_flight=8, queued=0, max_concurrency=32),
    ]

    assert pool_saturation(engines) == {"job-a": 160 / 128, "job-b": 0.25}


def test_saturation_gauge_is_exported_per_pool_and_zero_for_a_pool_without_engines() -> None:
    metrics = Metrics("router")
    engines = [_engine("job-a", "http://a1", in_flight=48, queued=0)]
    collector = EngineCollector(metrics, lambda: engines, lambda: [_pool("job-a", 1), _pool("job-empty", 0)])

    (family,) = [family for family in collector.collect() if family.name == "miles_router_pool_saturation_ratio"]

    assert {sample.labels["pool"]: sample.value for sample in family.samples} == {"job-a": 0.75, "job-empty": 0.0}
