"""The radix prefix cache: longest-prefix matches, splits, locks, LRU eviction, flush with locked nodes, and
SGLang's cap on cached_tokens."""

from __future__ import annotations

from typing import Any

from miles.engine.radix_cache import RadixCache, cached_tokens_limit


class Block:
    """A stand-in KV payload that records which token positions it covers."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def split_at(self, n: int) -> tuple[Any, Any]:
        return Block(self.start, self.start + n), Block(self.start + n, self.end)


def _insert(cache: RadixCache, tokens: list[int], namespace: str | None = None) -> int:
    return cache.insert(tokens, Block, namespace)


def test_cached_tokens_limit_follows_sglang() -> None:
    assert cached_tokens_limit(10, False, -1) == 9
    assert cached_tokens_limit(10, True, -1) == 9
    assert cached_tokens_limit(10, True, 4) == 4
    assert cached_tokens_limit(10, True, 0) == 0
    assert cached_tokens_limit(10, False, 4) == 9
    assert cached_tokens_limit(1, False, -1) == 0


def test_match_splits_nodes_and_returns_the_kv_of_the_path() -> None:
    cache = RadixCache()
    assert _insert(cache, [1, 2, 3, 4, 5]) == 0
    assert _insert(cache, [1, 2, 3, 9]) == 3
    assert cache.num_tokens == 6
    match = cache.match([1, 2, 3, 4, 7], limit=5)
    assert match.length == 4
    assert [(b.start, b.end) for b in match.kv_blocks] == [(0, 3), (3, 4)]
    assert cache.match([1, 2, 3, 4, 5, 6], limit=3).length == 3
    assert cache.match([2, 3], limit=2).length == 0
    assert cache.num_tokens == 6


def test_namespaces_never_share() -> None:
    cache = RadixCache()
    _insert(cache, [1, 2, 3], namespace="a")
    assert cache.match([1, 2, 3], 3, namespace="b").length == 0
    assert cache.match([1, 2, 3], 3, namespace="a").length == 3


def test_lru_eviction_removes_least_recently_used_leaves_and_spares_locked_paths() -> None:
    cache = RadixCache()
    _insert(cache, [1, 1, 1, 1])
    _insert(cache, [2, 2, 2, 2])
    _insert(cache, [3, 3, 3, 3])
    cache.match([1, 1, 1, 1], 4)
    locked = cache.match([2, 2, 2, 2], 4)
    cache.lock(locked.node)
    assert cache.num_locked_tokens == 4
    assert cache.evict(1) == 4
    assert cache.match([3, 3, 3, 3], 4).length == 0
    assert cache.evict(100) == 4
    assert cache.match([1, 1, 1, 1], 4).length == 0
    assert cache.match([2, 2, 2, 2], 4).length == 4
    cache.unlock(locked.node)
    assert cache.num_locked_tokens == 0
    assert cache.evict(100) == 4
    assert cache.num_tokens == 0


def test_eviction_walks_up_to_parents_that_become_leaves() -> None:
    cache = RadixCache()
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [1, 2, 5, 6])
    assert cache.evict(5) == 6
    assert cache.num_tokens == 0


def test_flush_detaches_locked_nodes_until_they_are_unlocked() -> None:
    cache = RadixCache()
    _insert(cache, [1, 2, 3, 4])
    _insert(cache, [7, 8])
    match = cache.match([1, 2, 3, 4, 5], 4)
    cache.lock(match.node)
    cache.flush()
    assert cache.num_tokens == 0
    assert cache.num_detached_tokens == 4
    assert cache.match([1, 2, 3, 4, 5], 4).length == 0
    _insert(cache, [1, 2, 3])
    assert cache.num_tokens == 3
    cache.unlock(match.node)
    assert cache.num_detached_tokens == 0
    assert cache.num_locked_tokens == 0


def test_disabled_cache_never_matches() -> None:
    cache = RadixCache(enabled=False)
    assert _insert(cache, [1, 2, 3]) == 0
    assert cache.match([1, 2, 3], 3).length == 0
    assert cache.num_tokens == 0
