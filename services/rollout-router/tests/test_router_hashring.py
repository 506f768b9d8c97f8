"""Consistent hashing with bounded load: stable answers, minimal movement, the load bound."""

from __future__ import annotations

import collections

from miles.router.hashring import HashRing

URLS = [f"http://10.0.0.{i}:30000" for i in range(4)]


def ring(urls: list[str]) -> HashRing:
    hash_ring = HashRing(vnodes_per_engine=150)
    for url in urls:
        hash_ring.add(url)
    return hash_ring


def test_same_key_same_engine_across_instances() -> None:
    first, second = ring(URLS), ring(list(reversed(URLS)))
    for key in (f"session-{i}" for i in range(200)):
        assert first.lookup(key, URLS, lambda _: 0, 1.25) == second.lookup(key, URLS, lambda _: 0, 1.25)


def test_keys_spread_over_engines() -> None:
    hash_ring = ring(URLS)
    counts = collections.Counter(hash_ring.lookup(f"k{i}", URLS, lambda _: 0, 10.0) for i in range(4000))
    assert set(counts) == set(URLS)
    assert min(counts.values()) > 4000 / 4 * 0.6


def test_leaving_engine_moves_only_its_keys() -> None:
    hash_ring = ring(URLS)
    keys = [f"k{i}" for i in range(2000)]
    before = {key: hash_ring.lookup(key, URLS, lambda _: 0, 10.0) for key in keys}
    survivors = URLS[1:]
    hash_ring.remove(URLS[0])
    after = {key: hash_ring.lookup(key, survivors, lambda _: 0, 10.0) for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == URLS[0] for key in moved)


def test_joining_engine_takes_a_fair_share_only() -> None:
    hash_ring = ring(URLS[:3])
    keys = [f"k{i}" for i in range(3000)]
    before = {key: hash_ring.lookup(key, URLS[:3], lambda _: 0, 10.0) for key in keys}
    hash_ring.add(URLS[3])
    after = {key: hash_ring.lookup(key, URLS, lambda _: 0, 10.0) for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert all(after[key] == URLS[3] for key in moved)
    assert len(moved) < len(keys) * 0.4


def test_bounded_load_skips_overloaded_engines() -> None:
    hash_ring = ring(URLS)
    loads = collections.Counter[str]()
    for i in range(400):
        url = hash_ring.lookup(f"k{i}", URLS, lambda candidate: loads[candidate], 1.25)
        assert url is not None
        loads[url] += 1
    # ceil(1.25 * (total + 1) / 4) bounds every engine at every step.
    assert max(loads.values()) <= -(-1.25 * 400 // 4) + 1


def test_lookup_only_returns_candidates() -> None:
    hash_ring = ring(URLS)
    for i in range(100):
        assert hash_ring.lookup(f"k{i}", URLS[2:], lambda _: 0, 1.25) in URLS[2:]
    assert hash_ring.lookup("k", [], lambda _: 0, 1.25) is None
