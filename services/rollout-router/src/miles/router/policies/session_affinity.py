"""session_affinity: every request of a routing key (a session) goes to the engine that holds its KV cache.

- Sticky hit: the key's engine is among the candidates → that engine.
- Sticky miss: the key's engine cannot take it (dead, removed, draining, behind min_weight_version, queue full, or
  it failed this request) → the key is re-homed by consistent hashing with bounded load, so the sessions of a lost
  engine spread evenly (no survivor takes more than hash_load_factor * its share) and identically on every router
  replica. The next turn re-prefills there; the move is counted as a miss.
- New key (or one forgotten after sticky_idle_s / beyond sticky_max_keys) → `new_key_placement`: prefix
  (default: cache_aware rules among the engines below their bounded-load share — the engine with the longest
  cached prefix of the prompt, e.g. a sibling episode of the same GRPO group, else the least-loaded), least_load
  (among equally loaded engines the one with the fewest sticky sessions) or hash (bounded-load consistent
  hashing). `make bench-router` chose the default: prefix keeps the most cache (a GRPO group's later episodes
  find their shared prompt) at the same balance; the bound matters, without it a system prompt that every
  session shares pulled every new session onto one engine.
- No key → placed like a new key, and nothing is remembered.
Keys of LoRA requests are (lora_path, session) pairs (routing_input.py): a session's KV lives under the adapter
version it was served with, so a turn under a new version is a new key, placed where that version's prefixes are.
Engines that join take no existing session (that would cost a cache miss); they fill up with new keys.

Limits: the sticky table lives in this router process; with several router replicas use new_key_placement=hash
(same answer everywhere while the engine set and loads agree) or route by session at the load balancer.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles.router.engine import Engine
from miles.router.hashring import HashRing, load_bound
from miles.router.policies.base import RoutingPolicy, Selection, StickyOutcome, least_loaded
from miles.router.policies.prefix import PrefixConfig, PrefixIndex
from miles.router.routing_input import RoutingInput
from miles.router.settings import NewKeyPlacement


@dataclass
class _StickyEntry:
    url: str
    last_used_s: float


@dataclass(frozen=True)
class AffinityConfig:
    new_key_placement: NewKeyPlacement
    max_keys: int
    idle_s: float
    vnodes_per_engine: int
    hash_load_factor: float
    learn_from_outputs: bool


class SessionAffinityPolicy(RoutingPolicy):
    name = "session_affinity"

    def __init__(
        self, config: AffinityConfig, prefix: PrefixConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self.ring = HashRing(config.vnodes_per_engine)
        self.index = PrefixIndex(prefix) if config.new_key_placement == "prefix" else None
        self._sticky: collections.OrderedDict[str, _StickyEntry] = collections.OrderedDict()
        self._keys_per_url: collections.Counter[str] = collections.Counter()
        self._counter = itertools.count()

    def select(self, request: RoutingInput, candidates: Sequence[Engine]) -> Selection:
        key = request.routing_key
        if key is None:
            engine, branch = self._place_new(request, candidates, str(next(self._counter)))
            return Selection(engine, branch)
        now_s = self.clock()
        entry = self._lookup(key, now_s)
        if entry is not None:
            by_url = {engine.url: engine for engine in candidates}
            sticky_engine = by_url.get(entry.url)
            if sticky_engine is not None:
                entry.last_used_s = now_s
                self._sticky.move_to_end(key)
                self._record_prefix(request, sticky_engine)
                return Selection(sticky_engine, "sticky", StickyOutcome.HIT)
            engine = self._rehome(key, candidates)
            self._assign(key, engine.url, now_s)
            self._record_prefix(request, engine)
            return Selection(engine, "rehome", StickyOutcome.MISS)
        engine, branch = self._place_new(request, candidates, key)
        self._assign(key, engine.url, now_s)
        return Selection(engine, branch, StickyOutcome.NEW)

    def sticky_engine_url(self, key: str) -> str | None:
        """The engine a key is sticky to now (None when unknown or expired)."""
        entry = self._lookup(key, self.clock())
        return entry.url if entry is not None else None

    def num_sticky_keys(self, url: str) -> int:
        return self._keys_per_url.get(url, 0)

    def cache_tree_units(self, url: str) -> int:
        return self.index.units_of(url) if self.index is not None else 0

    def on_engine_added(self, engine: Engine) -> None:
        self.ring.add(engine.url)

    def on_engine_removed(self, url: str) -> None:
        # Sticky entries stay: the next request of each key finds its engine gone, moves and counts as a miss.
        self.ring.remove(url)
        if self.index is not None:
            self.index.forget(url)

    def on_engine_reset(self, url: str) -> None:
        if self.index is not None:
            self.index.forget(url)

    def on_response(self, engine: Engine, request: RoutingInput, continuation_key: bytes) -> None:
        if self.index is not None and self.config.learn_from_outputs and continuation_key and not engine.removed:
            self.index.record(request.prefix_key + continuation_key, engine)

    def _place_new(self, request: RoutingInput, candidates: Sequence[Engine], tie_key: str) -> tuple[Engine, str]:
        placement = self.config.new_key_placement
        if placement == "hash":
            return self._rehome(tie_key, candidates), "hash"
        if placement == "prefix" and self.index is not None:
            eligible = self._under_load_bound(candidates)
            engine, branch = self.index.choose(
                request.prefix_key, eligible, tie_key, self.num_sticky_keys, request.namespace_units
            )
            self.index.record(request.prefix_key, engine)
            return engine, branch
        return least_loaded(candidates, tie_key, self.num_sticky_keys), "least_load"

    def _under_load_bound(self, candidates: Sequence[Engine]) -> list[Engine]:
        """prefix placement: only engines below the bounded-load share compete for a new key. A prefix that every
        session shares (a system prompt) would otherwise pull every new session onto the first engine that saw it:
        cache_aware's imbalance thresholds (64 requests) never fire in a pool with fewer requests in flight."""
        bound = load_bound(
            sum(engine.slots.load_requests for engine in candidates), len(candidates), self.config.hash_load_factor
        )
        return [engine for engine in candidates if engine.slots.load_requests < bound]

    def _rehome(self, key: str, candidates: Sequence[Engine]) -> Engine:
        by_url = {engine.url: engine for engine in candidates}
        url = self.ring.lookup(
            key, by_url, lambda candidate: by_url[candidate].slots.load_requests, self.config.hash_load_factor
        )
        return by_url[url] if url is not None else least_loaded(candidates, key, self.num_sticky_keys)

    def _record_prefix(self, request: RoutingInput, engine: Engine) -> None:
        if self.index is not None:
            self.index.record(request.prefix_key, engine)

    def _lookup(self, key: str, now_s: float) -> _StickyEntry | None:
        entry = self._sticky.get(key)
        if entry is not None and now_s - entry.last_used_s > self.config.idle_s:
            self._forget(key)
            return None
        return entry

    def _assign(self, key: str, url: str, now_s: float) -> None:
        old = self._sticky.get(key)
        if old is not None:
            self._decrement(old.url)
        self._sticky[key] = _StickyEntry(url, now_s)
        self._sticky.move_to_end(key)
        self._keys_per_url[url] += 1
        self._expire(now_s)

    def _expire(self, now_s: float) -> None:
        """Drop keys beyond max_keys and idle ones at the LRU end (amortised O(1) per request)."""
        while self._sticky:
            oldest_key, oldest = next(iter(self._sticky.items()))
            if len(self._sticky) <= self.config.max_keys and now_s - oldest.last_used_s <= self.config.idle_s:
                break
            self._forget(oldest_key)

    def _forget(self, key: str) -> None:
        entry = self._sticky.pop(key, None)
        if entry is not None:
            self._decrement(entry.url)

    def _decrement(self, url: str) -> None:
        self._keys_per_url[url] -= 1
        if self._keys_per_url[url] <= 0:
            del self._keys_per_url[url]
