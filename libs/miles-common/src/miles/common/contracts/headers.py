"""HTTP header names that one miles service sends and another reads (canonical spelling).

HTTP header names are case-insensitive; code that looks them up in a lower-cased mapping uses `.lower()`.
"""

from __future__ import annotations

POOL_HEADER = "X-Miles-Pool"
"""Engine pool a data-plane request goes to (session server -> router; absent: the router's default pool)."""

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""Affinity key of a request (the session id), SGLang model gateway's name (session server -> router)."""

MIN_WEIGHT_VERSION_HEADER = "X-Miles-Min-Weight-Version"
"""Oldest weight version a request accepts, an integer (read by the router to pick an engine and by the engine,
which answers 409 while it serves an older version)."""

SESSION_MIN_WEIGHT_VERSION_KEY = "min_weight_version"
"""Session metadata key (an integer >= 0) the session server sends as `MIN_WEIGHT_VERSION_HEADER` on every turn of
that session: how a rollout worker pins an evaluation episode to a weight version (`miles.rollout.eval_loop`)."""
