"""cache_aware: route by longest cached prefix unless load is imbalanced (the SGLang router's default policy)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from miles.router.engine import Engine
from miles.router.policies.base import RoutingPolicy, Selection
from miles.router.policies.prefix import PrefixConfig, PrefixIndex
from miles.router.routing_input import RoutingInput


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, config: PrefixConfig, *, learn_from_outputs: bool = True) -> None:
        self.index = PrefixIndex(config)
        self.learn_from_outputs = learn_from_outputs
        self._counter = itertools.count()

    def select(self, request: RoutingInput, candidates: Sequence[Engine]) -> Selection:
        tie_key = request.routing_key or str(next(self._counter))
        engine, branch = self.index.choose(
            request.prefix_key, candidates, tie_key, namespace_units=request.namespace_units
        )
        self.index.record(request.prefix_key, engine)
        return Selection(engine, branch)

    def on_response(self, engine: Engine, request: RoutingInput, continuation_key: bytes) -> None:
        if self.learn_from_outputs and continuation_key and not engine.removed:
            self.index.record(request.prefix_key + continuation_key, engine)

    def on_engine_removed(self, url: str) -> None:
        self.index.forget(url)

    def on_engine_reset(self, url: str) -> None:
        self.index.forget(url)

    def cache_tree_units(self, url: str) -> int:
        return self.index.units_of(url)
