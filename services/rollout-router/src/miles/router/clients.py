"""One HTTP connection pool per engine, for forwarding and probes.

Why not one client for all engines: httpx's connection pool (httpcore 1.0) scans all of its connections, several
times each and with a poll() syscall per connection, whenever a request is queued or a response is closed. With
one pool for every engine that is O(connections²) work per request, and it was most of the router's CPU in
`make bench-router` (4 engines, 32 sessions in flight). A pool per engine keeps each scan to that engine's own
few connections.

Idle connections are closed after `KEEPALIVE_EXPIRY_S`, below the engines' own keep-alive timeout (uvicorn's
default 5 s, which SGLang and miles-engine use), so the router does not send a request on a connection the
engine is closing at that moment (that fails like a dead engine, and would be retried elsewhere).

An engine's pool is retired when the engine leaves its pool: it is dropped at once (a re-registered engine gets a
fresh one) and closed once the engine's in-flight requests have finished, or after `retire_timeout_s`.

Every client carries the router's `engine_api_key` (when set) as `Authorization: Bearer`, like SGLang router's
worker api_key, so probes and forwarded requests reach engines that require a key.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from miles.common.auth import bearer_headers
from miles.common.http_client import ENGINE_KEEPALIVE_EXPIRY_S, traced_async_client
from miles.router.engine import Engine
from miles.router.settings import RouterSettings

log = logging.getLogger(__name__)

KEEPALIVE_EXPIRY_S = ENGINE_KEEPALIVE_EXPIRY_S


class EngineClients:
    def __init__(self, settings: RouterSettings, retire_timeout_s: float | None = None) -> None:
        self._timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)
        self._limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self.auth_headers = bearer_headers(settings.engine_api_key.get_secret_value())
        """Headers every engine request carries ({} when the router has no engine_api_key)."""
        self._retire_timeout_s = retire_timeout_s if retire_timeout_s is not None else settings.request_timeout_s
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._retiring: dict[asyncio.Task[None], httpx.AsyncClient] = {}

    def get(self, url: str) -> httpx.AsyncClient:
        """The client of one engine base URL (created on first use)."""
        client = self._clients.get(url)
        if client is None:
            client = traced_async_client(
                timeout=self._timeout,
                limits=self._limits,
                headers=self.auth_headers,
                follow_redirects=False,
                trust_env=False,
            )
            self._clients[url] = client
        return client

    def retire(self, engine: Engine) -> None:
        """The engine left its pool: close its client once its requests have finished."""
        client = self._clients.pop(engine.url, None)
        if client is None:
            return
        task = asyncio.get_running_loop().create_task(self._close_when_idle(engine, client))
        self._retiring[task] = client
        task.add_done_callback(self._forget_retired)

    async def _close_when_idle(self, engine: Engine, client: httpx.AsyncClient) -> None:
        if not await engine.slots.wait_idle(self._retire_timeout_s):
            log.warning("closing the client of a removed engine with requests in flight", extra={"engine": engine.url})
        await client.aclose()

    def _forget_retired(self, task: asyncio.Task[None]) -> None:
        self._retiring.pop(task, None)

    async def aclose(self) -> None:
        """Close every client now (the router is stopping), retiring ones included."""
        retiring = dict(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        clients = [*self._clients.values(), *retiring.values()]
        self._clients = {}
        await asyncio.gather(*(client.aclose() for client in clients))
