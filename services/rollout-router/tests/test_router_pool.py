"""Pool-level routing rules: availability, version gating (409), backpressure (429), drain, pool isolation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles.common.contracts.weight_version import parse_weight_version
from miles.router.engine import EngineState
from miles.router.errors import BackpressureError, NoRoutableEngineError, WeightVersionTooOldError


def test_empty_and_unhealthy_pools_answer_503_with_a_reason(make_pool: Any, make_routing: Any) -> None:
    _, empty, _ = make_pool(0)
    with pytest.raises(NoRoutableEngineError, match="no engines registered"):
        empty.select(make_routing("s"))
    _, pool, engines = make_pool(2)
    engines[0].health.force(False)
    pool.drain(engines[1])
    with pytest.raises(NoRoutableEngineError, match=r"no available engine \(1 drained, 1 unhealthy\)"):
        pool.select(make_routing("s"))


async def test_a_request_waits_while_the_only_engine_is_drained_for_an_update(
    make_pool: Any, make_routing: Any
) -> None:
    """A lone engine drained for a weight update: acquire holds the request until it is undrained (not 503); an
    unhealthy engine that is not drained is not waited for, and the hold ends at transient_hold_s."""
    _, pool, engines = make_pool(1, transient_hold_s=5.0)
    (engine,) = engines
    pool.drain(engine)
    held = asyncio.create_task(pool.acquire(make_routing("s")))
    await asyncio.sleep(0.2)
    assert not held.done()  # waiting, not refused
    engine.draining = False  # weight-sync undrains it after the update
    lease = await asyncio.wait_for(held, 5.0)
    assert lease.engine is engine
    lease.release()

    engine.health.force(False)  # unhealthy and not drained: nothing says it comes back soon
    with pytest.raises(NoRoutableEngineError, match="1 unhealthy"):
        await asyncio.wait_for(pool.acquire(make_routing("s")), 1.0)

    _, short, (lone,) = make_pool(1, transient_hold_s=0.2)
    short.drain(lone)
    with pytest.raises(NoRoutableEngineError, match="1 drained"):
        await asyncio.wait_for(short.acquire(make_routing("s")), 5.0)  # gives up after the hold


def test_paused_engines_take_no_requests_until_a_generation_check_passes(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(2)
    assert pool.record_serving(engines[0], False, failures_to_pause=1)  # registration: one failure decides
    assert engines[0].state() is EngineState.UNHEALTHY and not engines[0].is_available()
    assert all(pool.select(make_routing(f"s{i}")).engine is engines[1] for i in range(10))
    for _ in range(2):  # a serving engine: paused only after `failures_to_pause` consecutive failures
        assert not pool.record_serving(engines[1], False, failures_to_pause=3)
    assert engines[1].is_available()
    assert pool.record_serving(engines[1], False, failures_to_pause=3)
    with pytest.raises(NoRoutableEngineError, match=r"no available engine \(2 paused\)"):
        pool.select(make_routing("s"))
    assert pool.record_serving(engines[0], True, failures_to_pause=3)  # one success ends the pause
    assert pool.select(make_routing("s")).engine is engines[0]
    assert pool.record_serving(engines[1], None, failures_to_pause=1)  # no such route: never paused by it
    assert engines[1].is_available() and not engines[1].serving_check_supported


def test_an_engine_joining_behind_the_pool_waits_for_its_newest_version(make_pool: Any, make_routing: Any) -> None:
    registry, pool, engines = make_pool(2)  # a job's first engines, at the initial weights: admitted at once
    assert all(engine.admit_at_version is None for engine in engines)
    engines[0].weight_version, engines[1].weight_version = 3, 2  # versions 2 and 3 published (a rolling update)
    joining = registry.new_engine(pool.name, "http://joining:1", engines[0].source)
    joining.health.force(True)
    pool.add(joining)  # its version is not read yet (None): it waits for the newest, 3
    assert (joining.admit_at_version, joining.state(), joining.is_available()) == (3, EngineState.UNHEALTHY, False)
    assert all(pool.select(make_routing(f"s{i}")).engine is not joining for i in range(20))
    pool.record_version(joining, 2, authoritative=True)  # weight-sync is on its way: 2 is still behind
    assert not joining.is_available() and pool.snapshot(joining).admit_at_version == 3
    engines[0].health.force(False)
    engines[1].health.force(False)
    with pytest.raises(NoRoutableEngineError, match=r"1 joining \(waiting for version 3\)"):
        pool.select(make_routing("s"))
    pool.record_version(joining, 3, authoritative=True)
    assert joining.admit_at_version is None and pool.select(make_routing("s")).engine is joining
    pool.record_version(joining, 2, authoritative=True)  # admitted: behind in a later roll, it still serves
    assert joining.is_available()


def test_an_engine_back_from_a_restart_on_older_weights_waits_like_a_joining_one(make_pool: Any) -> None:
    _, pool, engines = make_pool(3)
    for engine in engines:
        engine.weight_version = 4
    for _ in range(5):  # it dies (health checks fail until it is marked unhealthy)
        pool.record_health(engines[0], False)
    assert not engines[0].health.healthy
    pool.record_version(engines[0], 0, authoritative=True)  # restarted at the same address on the initial weights
    for _ in range(5):
        pool.record_health(engines[0], True)
    assert engines[0].health.healthy and engines[0].admit_at_version == 4 and not engines[0].is_available()
    for _ in range(5):  # an engine that was only unreachable for a while still holds the newest weights
        pool.record_health(engines[1], False)
    for _ in range(5):
        pool.record_health(engines[1], True)
    assert engines[1].admit_at_version is None and engines[1].is_available()


def test_open_circuit_takes_an_engine_out_until_half_open(make_pool: Any, make_routing: Any, clock: Any) -> None:
    _, pool, engines = make_pool(2, clock=clock, circuit_failure_threshold=2, circuit_open_s=5.0)
    for _ in range(2):
        engines[0].breaker.record_failure(clock.now_s)
    assert engines[0].state(clock.now_s) is EngineState.UNHEALTHY
    assert all(pool.select(make_routing(f"s{i}")).engine is engines[1] for i in range(20))
    clock.now_s += 5
    assert engines[0].is_available(clock.now_s)


def test_min_weight_version_gates_engines(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(3)
    engines[1].weight_version = 2
    engines[2].weight_version = None  # unknown never satisfies a minimum
    for i in range(10):
        assert pool.select(make_routing(f"s{i}", min_version=2)).engine is engines[1]
    with pytest.raises(WeightVersionTooOldError) as caught:
        pool.select(make_routing("s", min_version=3))
    error = caught.value
    assert error.http_status == 409 and error.retryable
    assert error.details["newest"] == 2 and error.details["min_weight_version"] == 3
    assert pool.select(make_routing("s", min_version=None)).engine in engines


def test_an_engine_restarted_on_the_initial_weights_is_followed_back_to_version_0(make_pool: Any) -> None:
    """A poll answering SGLang's "default" reads as version 0 (miles.common.contracts.weight_version), not unknown."""
    _, pool, engines = make_pool(1)
    pool.record_version(engines[0], 5, authoritative=True)
    pool.record_version(engines[0], parse_weight_version("default"), authoritative=True)
    assert engines[0].weight_version == 0
    assert engines[0].serves_version(0) and not engines[0].serves_version(1)


def test_sticky_engine_behind_the_version_moves_the_session(make_pool: Any, make_routing: Any) -> None:
    from miles.router.policies import StickyOutcome

    _, pool, engines = make_pool(2)
    home = pool.select(make_routing("s")).engine
    other = engines[1] if home is engines[0] else engines[0]
    other.weight_version = 5
    moved = pool.select(make_routing("s", min_version=5))
    assert moved.engine is other and moved.sticky is StickyOutcome.MISS


def test_all_queues_full_is_backpressure(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(2, engine_max_concurrency=1, engine_max_queue=0, backpressure_retry_after_s=3.0)
    for engine in engines:
        engine.slots.num_in_flight = 1
    with pytest.raises(BackpressureError) as caught:
        pool.select(make_routing("s"))
    assert caught.value.http_status == 429 and caught.value.retry_after_s == 3.0
    engines[1].slots.num_in_flight = 0
    assert pool.select(make_routing("s")).engine is engines[1]


def test_full_sticky_engine_overflows_to_another(make_pool: Any, make_routing: Any) -> None:
    from miles.router.policies import StickyOutcome

    _, pool, _engines = make_pool(2, engine_max_concurrency=1, engine_max_queue=0)
    home = pool.select(make_routing("s")).engine
    home.slots.num_in_flight = 1
    overflow = pool.select(make_routing("s"))
    assert overflow.engine is not home and overflow.sticky is StickyOutcome.MISS


async def test_queued_request_moves_when_its_engine_drains(make_pool: Any, make_routing: Any) -> None:
    _, pool, engines = make_pool(2, engine_max_concurrency=1, engine_max_queue=4)
    first = await pool.acquire(make_routing("s"))
    home = first.engine
    other = engines[1] if home is engines[0] else engines[0]
    queued = asyncio.create_task(pool.acquire(make_routing("s")))  # sticky: waits in its engine's queue
    for _ in range(5):
        await asyncio.sleep(0)
    assert home.slots.num_queued == 1
    pool.drain(home)  # the queued request is sent away and re-selected
    lease = await queued
    assert lease.engine is other
    assert home.state() is EngineState.DRAINING
    first.release()
    assert home.state() is EngineState.DRAINED
    lease.release()


def test_pools_never_share_engines(make_pool: Any, make_routing: Any) -> None:
    registry, pool_a, engines_a = make_pool(2, pool_name="job-a")
    pool_b = registry.get_or_create("job-b")
    engine_b = registry.new_engine("job-b", "http://b:1", engines_a[0].source)
    engine_b.health.force(True)
    pool_b.add(engine_b)
    for i in range(30):
        assert pool_a.select(make_routing(f"s{i}", pool="job-a")).engine in engines_a
        assert pool_b.select(make_routing(f"s{i}", pool="job-b")).engine is engine_b
    for engine in engines_a:
        engine.health.force(False)
    with pytest.raises(NoRoutableEngineError):
        pool_a.select(make_routing("s", pool="job-a"))  # never falls back to job-b's healthy engine
    with pytest.raises(NoRoutableEngineError, match="no engine pool named 'job-c'"):
        registry.for_request("job-c")


def test_stats_count_per_pool(make_pool: Any) -> None:
    registry, pool, _engines = make_pool(2)
    pool.counters.request("/generate")
    pool.counters.tokens(100, 80)
    pool.counters.failure("version_conflict")
    stats = pool.stats()
    assert (stats.requests_total, stats.prompt_tokens_total, stats.cached_tokens_total) == (1, 100, 80)
    assert stats.prefix_hit_rate == pytest.approx(0.8)
    assert stats.version_conflicts_total == 1 and stats.failures_total == 1
    assert stats.num_engines == 2 and stats.num_healthy_engines == 2
    other = registry.get_or_create("other").stats()
    assert other.requests_total == 0 and other.prefix_hit_rate == 0.0
