"""Errors the router raises on purpose, each mapped to its HTTP/gRPC status by miles.common.

Errors about the forwarded request's *content* are never raised here: the engine judges the body and its answer
(e.g. 400 for malformed JSON) is passed through unchanged. These classes cover what the router itself decides.
"""

from __future__ import annotations

from miles.common.errors import (
    ConflictError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)


class NoRoutableEngineError(UnavailableError):
    """503: the pool is unknown or none of its engines can take a request now (unhealthy, drained, circuit open,
    or every one failed this request). Retryable."""

    code = "no_routable_engine"


class WeightVersionTooOldError(ConflictError):
    """409: the request demands min_weight_version and no available engine of the pool serves it yet. Retryable
    once an engine has been updated."""

    code = "weight_version_too_old"


class BackpressureError(ResourceExhaustedError):
    """429: every available engine's queue is full, or the request waited in a queue beyond queue_timeout_s."""

    code = "backpressure"


class EngineUnreachableError(UnavailableError):
    """503: every attempt failed with a connection error before any response byte was received."""

    code = "engine_unreachable"


class InvalidRoutingInputError(InvalidArgumentError):
    """400: a routing input the router reads itself is invalid (e.g. X-Miles-Min-Weight-Version is not an integer,
    or an admin URL without http/https)."""

    code = "invalid_routing_input"


class EngineNotFoundError(NotFoundError):
    """404: the admin API names a pool or engine the router does not know."""

    code = "engine_not_found"
