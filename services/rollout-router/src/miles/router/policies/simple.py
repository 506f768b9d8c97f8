"""least_load and round_robin: the two policies that keep no per-request state."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from miles.router.engine import Engine
from miles.router.policies.base import RoutingPolicy, Selection, least_loaded
from miles.router.routing_input import RoutingInput


class LeastLoadPolicy(RoutingPolicy):
    """The engine with the fewest requests in flight + queued (then fewest tokens)."""

    name = "least_load"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, request: RoutingInput, candidates: Sequence[Engine]) -> Selection:
        tie_key = request.routing_key or str(next(self._counter))
        return Selection(least_loaded(candidates, tie_key), "least_load")


class RoundRobinPolicy(RoutingPolicy):
    """Candidates in turn (a counter modulo the number of candidates, as the SGLang router does)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, request: RoutingInput, candidates: Sequence[Engine]) -> Selection:
        return Selection(candidates[next(self._counter) % len(candidates)], "round_robin")
