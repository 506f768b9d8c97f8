"""The SGLang router's cache_aware decision over a token-level prefix tree (docs/sglang-protocol.md §6.4).

For one request among the candidates:
1. If load is imbalanced — (max - min) > balance_abs_threshold and max > min * balance_rel_threshold, loads in
   requests in flight + queued — take the least-loaded engine.
2. Else match the prompt in the tree; the candidate with the longest match wins if matched / prompt length is
   above cache_threshold (strictly) — unless it *spills* (below) — else the least-loaded engine.
   Spill gate (smg 1.13's): the prefix holder is passed over for the least-loaded engine when its load exceeds
   the candidates' mean load by a margin — balance_abs_threshold, capped at two standard deviations of an
   in-flight count at that mean, 2 * sqrt(mean), but not below 4 — and exceeds mean * balance_rel_threshold.
   Step 1 alone (SGLang's router before smg 1.x) never fires while fewer than balance_abs_threshold requests are
   in flight, so a prefix every request shares (a system prompt) pulled all traffic onto one engine; the gate
   bounds that pile-up to the natural swing of the load.
3. Record the prompt for the chosen engine in the tree (in every branch, as SGLang does), then evict that
   engine's least recently used entries beyond its budget: the KV capacity the engine reports, else
   cache_tree_max_tokens_per_engine.

Differences from SGLang, on purpose: token ids instead of characters when the request has them; the winner is the
candidate with the longest match (so an unavailable tenant on the deepest node costs nothing); the tree also
learns each answer's output tokens (what the engine caches after the turn), so a conversation's next turn
matches in full; an engine's entries are dropped when it loses its cache (new weights, restart); keys are
namespaced by the request's LoRA adapter (routing_input.py), as the engines' caches are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles.router.engine import Engine
from miles.router.policies.base import least_loaded
from miles.router.radix import RadixTree, num_units


@dataclass(frozen=True)
class PrefixConfig:
    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    default_budget_tokens: int


class PrefixIndex:
    """A pool's prefix tree plus the cache_aware choice."""

    def __init__(self, config: PrefixConfig) -> None:
        self.config = config
        self.tree = RadixTree()

    def is_imbalanced(self, candidates: Sequence[Engine]) -> bool:
        loads = [engine.slots.load_requests for engine in candidates]
        max_load, min_load = max(loads), min(loads)
        return (
            max_load - min_load > self.config.balance_abs_threshold
            and max_load > min_load * self.config.balance_rel_threshold
        )

    def spills(self, engine: Engine, candidates: Sequence[Engine]) -> bool:
        """The spill gate of step 2 (module docstring)."""
        mean = sum(candidate.slots.load_requests for candidate in candidates) / len(candidates)
        margin = min(self.config.balance_abs_threshold, max(4.0, 2.0 * math.sqrt(mean)))
        load = engine.slots.load_requests
        return load - mean > margin and load > mean * self.config.balance_rel_threshold

    def best_match(
        self,
        key: bytes,
        candidates: Sequence[Engine],
        namespace_units: int = 0,
        tie_key: str = "",
        num_keys: Callable[[str], int] | None = None,
    ) -> tuple[Engine | None, float]:
        """The candidate holding the longest prefix of `key` and its match rate. Engines that match equally long
        (a system prompt every engine has cached) are ordered as base.least_loaded orders them: fewest requests,
        fewest sticky sessions, fewest tokens, then a hash of (tie_key, url); never by registration order, which
        sent every such tie to the first engine. The first `namespace_units` of the key name an adapter
        (radix.encode_namespace): they count in neither the match nor the prompt, so other prompts of the same
        adapter are no hit."""
        if num_units(key) <= namespace_units:
            return None, 0.0
        matched = self.tree.match(key)
        best_len = max((matched.get(engine.url, 0) for engine in candidates), default=0)
        if best_len == 0:
            return None, 0.0
        tied = [engine for engine in candidates if matched.get(engine.url, 0) == best_len]
        best = least_loaded(tied, tie_key, num_keys)
        prompt_matched = max(0, best_len - namespace_units)
        return best, prompt_matched / (num_units(key) - namespace_units)

    def choose(
        self,
        key: bytes,
        candidates: Sequence[Engine],
        tie_key: str,
        num_keys: Callable[[str], int] | None = None,
        namespace_units: int = 0,
    ) -> tuple[Engine, str]:
        """cache_aware steps 1-2: (engine, branch) with branch in imbalanced | prefix | low_match. `num_keys` breaks
        least-loaded ties by fewest sticky sessions (see base.least_loaded); `namespace_units` as in best_match."""
        if len(candidates) > 1 and self.is_imbalanced(candidates):
            return least_loaded(candidates, tie_key, num_keys), "imbalanced"
        best, rate = self.best_match(key, candidates, namespace_units, tie_key, num_keys)
        if best is not None and rate > self.config.cache_threshold:
            if len(candidates) > 1 and self.spills(best, candidates):
                return least_loaded(candidates, tie_key, num_keys), "spill"
            return best, "prefix"
        return least_loaded(candidates, tie_key, num_keys), "low_match"

    def record(self, key: bytes, engine: Engine) -> None:
        """Step 3: the engine now (probably) caches `key`; keep its share of the tree within budget."""
        if not key:
            return
        self.tree.insert(key, engine.url)
        self.tree.evict(engine.url, engine.kv_capacity_tokens or self.config.default_budget_tokens)

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def units_of(self, url: str) -> int:
        return self.tree.tenant_units(url)
