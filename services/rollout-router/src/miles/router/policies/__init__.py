"""Routing policies behind one interface (`RoutingPolicy`), chosen per pool by `make_policy`."""

from __future__ import annotations

import time
from collections.abc import Callable

from miles.router.policies.base import RoutingPolicy, Selection, StickyOutcome, least_loaded
from miles.router.policies.cache_aware import CacheAwarePolicy
from miles.router.policies.prefix import PrefixConfig
from miles.router.policies.session_affinity import AffinityConfig, SessionAffinityPolicy
from miles.router.policies.simple import LeastLoadPolicy, RoundRobinPolicy
from miles.router.settings import PolicyName, RouterSettings

__all__ = [
    "CacheAwarePolicy",
    "LeastLoadPolicy",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "Selection",
    "SessionAffinityPolicy",
    "StickyOutcome",
    "least_loaded",
    "make_policy",
]


def prefix_config(settings: RouterSettings) -> PrefixConfig:
    return PrefixConfig(
        cache_threshold=settings.cache_threshold,
        balance_abs_threshold=settings.balance_abs_threshold,
        balance_rel_threshold=settings.balance_rel_threshold,
        default_budget_tokens=settings.cache_tree_max_tokens_per_engine,
    )


def make_policy(
    name: PolicyName, settings: RouterSettings, clock: Callable[[], float] = time.monotonic
) -> RoutingPolicy:
    """The policy instance of one pool."""
    if name == "session_affinity":
        affinity = AffinityConfig(
            new_key_placement=settings.new_key_placement,
            max_keys=settings.sticky_max_keys,
            idle_s=settings.sticky_idle_s,
            vnodes_per_engine=settings.hash_vnodes_per_engine,
            hash_load_factor=settings.hash_load_factor,
            learn_from_outputs=settings.learn_from_outputs,
        )
        return SessionAffinityPolicy(affinity, prefix_config(settings), clock)
    if name == "cache_aware":
        return CacheAwarePolicy(prefix_config(settings), learn_from_outputs=settings.learn_from_outputs)
    if name == "least_load":
        return LeastLoadPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}")
