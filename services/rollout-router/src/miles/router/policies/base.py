"""The interface every routing policy implements, and the least-loaded rule they share.

A policy sees only *candidates*: engines of one pool that are available, at the request's minimum weight
version, not already tried by this request, and with room in their queue (the pool filters; see pool.py). It
picks one and may update its own state (sticky table, prefix tree). It never blocks and never does I/O.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles.router.engine import Engine
from miles.router.hashring import hash64
from miles.router.routing_input import RoutingInput


class StickyOutcome(enum.Enum):
    HIT = "hit"
    """The routing key went to its sticky engine."""
    MISS = "miss"
    """The key had a sticky engine that could not take it (dead, removed, draining, behind, full): it moved."""
    NEW = "new"
    """The key was seen for the first time (or had been forgotten)."""


@dataclass(frozen=True)
class Selection:
    engine: Engine
    branch: str
    """Which rule decided, for metrics: sticky, rehome, least_load, prefix, low_match, imbalanced, spill, hash,
    round_robin."""
    sticky: StickyOutcome | None = None


class RoutingPolicy(abc.ABC):
    """One policy instance per pool."""

    name: str

    @abc.abstractmethod
    def select(self, request: RoutingInput, candidates: Sequence[Engine]) -> Selection:
        """Pick one of the (non-empty) candidates."""

    def on_engine_added(self, engine: Engine) -> None:  # noqa: B027 - optional hook
        """An engine joined the pool."""

    def on_engine_removed(self, url: str) -> None:  # noqa: B027 - optional hook
        """An engine left the pool."""

    def on_engine_reset(self, url: str) -> None:  # noqa: B027 - optional hook
        """An engine lost its KV cache (new weights, restart): forget what it caches."""

    def on_response(self, engine: Engine, request: RoutingInput, continuation_key: bytes) -> None:  # noqa: B027
        """The engine answered; `continuation_key` is what it now caches beyond the prompt (may be b"")."""

    def num_sticky_keys(self, url: str) -> int:
        """Routing keys currently sticky to an engine (0 for policies without stickiness)."""
        return 0

    def cache_tree_units(self, url: str) -> int:
        """Tokens (or characters) the policy's prefix tree attributes to an engine (0 without a tree)."""
        return 0


def least_loaded(candidates: Sequence[Engine], tie_key: str, num_keys: Callable[[str], int] | None = None) -> Engine:
    """The engine with the fewest requests in flight + queued; then (when `num_keys` is given) the fewest sticky
    sessions, so idle engines share new sessions evenly; then the fewest tokens; remaining ties are broken by a
    hash of (tie_key, url), so equal engines share new work instead of the first one taking all."""
    return min(
        candidates,
        key=lambda engine: (
            engine.slots.load_requests,
            num_keys(engine.url) if num_keys is not None else 0,
            engine.slots.load_tokens,
            hash64(f"{tie_key}|{engine.url}"),
        ),
    )
