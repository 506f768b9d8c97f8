"""The data plane: one request in, one engine chosen, the engine's answer out — bytes unchanged.

For each attempt the pool selects an engine and a slot on it (pool.py), the body goes to the engine as received,
and then:
- connection error, or a status in `retry_on_status` (or 409 while the request demands a weight version the
  router thought the engine had) → the attempt is recorded against the engine (passive health, breaker) and the
  request goes to another engine after a backoff — up to `max_attempts` attempts, never once a byte has reached
  the client. On the last attempt an engine status is passed through; connection errors become 503;
- a JSON (non-stream) answer is read whole, so an engine dying mid-body is still retried, then passed on;
- an SSE answer is held until its first chunk arrives (dying before it is retried), then relayed chunk by chunk.
  If the engine dies mid-stream the client gets one SGLang-style error event (`data: {"error": {...}}`) and
  `data: [DONE]`, because the stream cannot be retried once started.
Counts (`meta_info.prompt_tokens`, `cached_tokens`, `weight_version`, output ids for the prefix tree) are read
from a copy of the bytes (the last SSE event for streams); the router never parses-and-rejects a body.

Limits: request bodies are read whole before forwarding (they are needed for routing); a compressed answer
(Content-Encoding) is passed on but not counted.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from miles.common.errors import MilesError
from miles.router.clients import EngineClients
from miles.router.engine import Engine
from miles.router.errors import (
    BackpressureError,
    EngineUnreachableError,
    InvalidRoutingInputError,
    NoRoutableEngineError,
    WeightVersionTooOldError,
)
from miles.router.policies import StickyOutcome
from miles.router.pool import EnginePool, Lease
from miles.router.registry import PoolRegistry
from miles.router.relay import StreamEnd, StreamRelay, is_plain
from miles.router.response_meta import ResponseMeta, continuation_key, meta_from_body
from miles.router.routing_input import RoutingInput, parse_routing_input
from miles.router.settings import RouterSettings

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the HTTP server recomputes; never copied across the proxy.
_SKIP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
    }
)
_FAILURE_REASON: dict[type[MilesError], str] = {
    NoRoutableEngineError: "no_engine",
    WeightVersionTooOldError: "version_conflict",
    BackpressureError: "backpressure",
    EngineUnreachableError: "engine_unreachable",
    InvalidRoutingInputError: "invalid_input",
}

VersionStaleHook = Callable[[EnginePool, Engine], None]


@dataclass
class ForwardedResponse:
    """An engine's answer: `body` when complete, else `stream` (must be iterated to the end or closed)."""

    status_code: int
    headers: list[tuple[str, str]]
    body: bytes | None = None
    stream: StreamRelay | None = None


@dataclass(frozen=True)
class _Retry:
    reason: str


class Forwarder:
    def __init__(
        self,
        registry: PoolRegistry,
        clients: EngineClients,
        settings: RouterSettings,
        on_version_stale: VersionStaleHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.settings = settings
        self.on_version_stale = on_version_stale
        self.clock = clock
        self.retry_statuses = frozenset(settings.retry_on_status)

    async def forward(self, route: str, method: str, headers: Mapping[str, str], body: bytes) -> ForwardedResponse:
        """Route one data-plane request and return the engine's answer (raises MilesError for router errors)."""
        request = parse_routing_input(route, headers, body, self.settings.default_pool)
        pool = self.registry.for_request(request.pool)
        pool.counters.request(route)
        try:
            forwarded_headers = _request_headers(headers, self.clients.auth_headers)
            return await self._attempts(pool, request, method, forwarded_headers, body)
        except MilesError as error:
            pool.counters.failure(_FAILURE_REASON.get(type(error), "engine_unreachable"))
            raise

    async def _attempts(
        self, pool: EnginePool, request: RoutingInput, method: str, headers: dict[str, str], body: bytes
    ) -> ForwardedResponse:
        excluded: set[str] = set()
        reasons: list[str] = []
        sticky: StickyOutcome | None = None
        try:
            for attempt in range(1, self.settings.max_attempts + 1):
                if attempt > 1:
                    pool.counters.retry()
                    await asyncio.sleep(self._backoff_s(attempt - 1))
                lease = await pool.acquire(request, excluded)
                pool.counters.decision(lease.selection.branch)
                pool.counters.queue_wait(lease.queue_wait_s)
                sticky = _final_sticky(sticky, lease.selection.sticky, attempt)
                is_last = attempt == self.settings.max_attempts
                outcome = await self._try_engine(pool, lease, request, method, headers, body, is_last)
                if isinstance(outcome, ForwardedResponse):
                    return outcome
                excluded.add(lease.engine.url)
                reasons.append(outcome.reason)
        finally:
            pool.counters.sticky(sticky)
        raise EngineUnreachableError(
            f"pool {pool.name!r}: no engine answered after {len(reasons)} attempts ({'; '.join(reasons)})",
            details={"pool": pool.name, "attempts": reasons},
        )

    async def _try_engine(
        self,
        pool: EnginePool,
        lease: Lease,
        request: RoutingInput,
        method: str,
        headers: dict[str, str],
        body: bytes,
        is_last: bool,
    ) -> ForwardedResponse | _Retry:
        engine = lease.engine
        client = self.clients.get(engine.url)
        upstream_request = client.build_request(method, engine.url + request.route, content=body, headers=headers)
        sent_s = self.clock()
        try:
            response = await client.send(upstream_request, stream=True)
        except httpx.TransportError as exc:
            lease.release()
            return self._transport_failed(pool, engine, exc, connected=False)
        pool.counters.upstream_headers(self.clock() - sent_s)
        status = response.status_code
        version_stale = status == 409 and request.min_weight_version is not None
        if (status in self.retry_statuses or version_stale) and not is_last:
            await response.aclose()
            lease.release()
            return self._status_failed(pool, engine, status, version_stale)
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._start_stream(pool, lease, request, response)
        try:
            content = await response.aread()
        except httpx.TransportError as exc:
            lease.release()
            return self._transport_failed(pool, engine, exc, connected=True)
        finally:
            await response.aclose()
        lease.release()
        meta = meta_from_body(content) if status == 200 and is_plain(response) else None
        self._record_outcome(pool, engine, request, status, meta)
        return ForwardedResponse(status, _response_headers(response), body=content)

    async def _start_stream(
        self, pool: EnginePool, lease: Lease, request: RoutingInput, response: httpx.Response
    ) -> ForwardedResponse | _Retry:
        chunks = response.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except httpx.TransportError as exc:
            await response.aclose()
            lease.release()
            return self._transport_failed(pool, lease.engine, exc, connected=True)
        stream = StreamRelay(response, chunks, first, functools.partial(self._stream_ended, pool, lease, request))
        return ForwardedResponse(response.status_code, _response_headers(response), stream=stream)

    def _stream_ended(self, pool: EnginePool, lease: Lease, request: RoutingInput, end: StreamEnd) -> None:
        lease.release()
        engine = lease.engine
        if end.broken:
            engine.breaker.record_failure(self.clock())
            pool.counters.engine_attempt(engine.url, "broken")
            pool.counters.failure("stream_broken")
        elif end.finished:
            self._record_outcome(pool, engine, request, end.status_code, end.meta)
        # else: the client went away; that says nothing about the engine.

    def _record_outcome(
        self, pool: EnginePool, engine: Engine, request: RoutingInput, status: int, meta: ResponseMeta | None
    ) -> None:
        if status >= 500:
            engine.breaker.record_failure(self.clock())
            pool.counters.engine_attempt(engine.url, "server_error")
            pool.counters.failure("engine_error")
        else:
            engine.breaker.record_success()
            pool.counters.engine_attempt(engine.url, "ok" if status < 400 else "client_error")
        if meta is None:
            return
        pool.counters.tokens(meta.num_prompt_tokens, meta.num_cached_tokens)
        pool.record_version(engine, meta.weight_version, authoritative=False)
        pool.policy.on_response(engine, request, continuation_key(request, meta))

    def _transport_failed(self, pool: EnginePool, engine: Engine, exc: httpx.TransportError, connected: bool) -> _Retry:
        """Connection refused/reset before an answer: a failed health observation, and a breaker failure."""
        if not connected and isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            pool.record_health(engine, False)
        engine.breaker.record_failure(self.clock())
        pool.counters.engine_attempt(engine.url, "connect_error")
        return _Retry(f"{engine.url}: {type(exc).__name__}")

    def _status_failed(self, pool: EnginePool, engine: Engine, status: int, version_stale: bool) -> _Retry:
        if version_stale:
            if self.on_version_stale is not None:
                self.on_version_stale(pool, engine)
            pool.counters.engine_attempt(engine.url, "client_error")
        else:
            if status >= 500:
                engine.breaker.record_failure(self.clock())
            pool.counters.engine_attempt(engine.url, "server_error" if status >= 500 else "client_error")
        return _Retry(f"{engine.url}: HTTP {status}")

    def _backoff_s(self, retry_index: int) -> float:
        settings = self.settings
        base = settings.retry_backoff_initial_s * settings.retry_backoff_multiplier ** (retry_index - 1)
        return min(settings.retry_backoff_max_s, base) * random.uniform(0.8, 1.2)


def _final_sticky(current: StickyOutcome | None, latest: StickyOutcome | None, attempt: int) -> StickyOutcome | None:
    """One sticky outcome per request: the first attempt's, unless a retry had to move the key (then a miss)."""
    if attempt == 1:
        return latest
    return StickyOutcome.MISS if latest is StickyOutcome.MISS else current


def _request_headers(headers: Mapping[str, str], engine_auth: Mapping[str, str]) -> dict[str, str]:
    """The client's headers as sent to the engine. With an engine key the router's Authorization replaces the
    client's (a token for the router is never passed on); without one the client's header goes through."""
    skipped = (_SKIP_HEADERS | {"authorization"}) if engine_auth else _SKIP_HEADERS
    forwarded = {name: value for name, value in headers.items() if name.lower() not in skipped}
    forwarded.update(engine_auth)
    if not any(name.lower() == "accept-encoding" for name in forwarded):
        forwarded["accept-encoding"] = "identity"  # else httpx asks for gzip and the counts become unreadable
    return forwarded


def _response_headers(response: httpx.Response) -> list[tuple[str, str]]:
    # x-request-id is set by the router's own middleware (the engine may echo the one we sent).
    return [
        (name, value)
        for name, value in response.headers.multi_items()
        if name.lower() not in _SKIP_HEADERS and name.lower() != "x-request-id"
    ]
