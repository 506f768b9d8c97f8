"""The job's engine pool at the rollout router, through the router's HTTP admin mirror (`/admin/v1/engines`).

The pool is named after the job id (the session server's job config names `engine_pool` = job id, so a session's
requests reach only its job's engines). Registration is idempotent by (pool, url) on the router's side, so the
backend simply re-registers whatever the router forgot (e.g. after a router restart: its registry is in memory).
"""

from __future__ import annotations

import logging

import httpx

from miles.common.auth import bearer_headers
from miles.common.http_client import traced_async_client

log = logging.getLogger(__name__)


class RouterPool:
    """Register / deregister / list the engines of one pool. No router URL: every call is a no-op."""

    def __init__(self, router_url: str, *, admin_token: str = "", timeout_s: float = 10.0) -> None:
        self.router_url = router_url.rstrip("/")
        self._http = traced_async_client(timeout=timeout_s, headers=bearer_headers(admin_token))

    @property
    def enabled(self) -> bool:
        return bool(self.router_url)

    async def register(self, pool: str, url: str) -> bool:
        """True once the router has the engine in `pool` (it probes the engine before answering)."""
        if not self.enabled:
            return True
        try:
            response = await self._http.post(
                f"{self.router_url}/admin/v1/engines", json={"pool": pool, "url": url, "max_concurrency": 0}
            )
        except httpx.HTTPError as exc:
            log.warning("router registration failed", extra={"pool": pool, "engine": url, "error": str(exc)})
            return False
        if response.status_code != 200:
            log.warning(
                "router refused registration",
                extra={"pool": pool, "engine": url, "status": response.status_code, "body": response.text[:300]},
            )
            return False
        return True

    async def deregister(self, pool: str, url: str, *, drain_timeout_s: float = 0.0) -> None:
        """Remove the engine from `pool` (draining it first, up to `drain_timeout_s`); unknown engine is fine."""
        if not self.enabled:
            return
        try:
            if drain_timeout_s > 0:
                await self._http.post(
                    f"{self.router_url}/admin/v1/engines/drain",
                    json={"pool": pool, "url": url, "wait": True, "timeout_s": drain_timeout_s},
                    timeout=drain_timeout_s + 10.0,
                )
            await self._http.post(f"{self.router_url}/admin/v1/engines/deregister", json={"pool": pool, "url": url})
        except httpx.HTTPError as exc:
            log.warning("router deregistration failed", extra={"pool": pool, "engine": url, "error": str(exc)})

    async def engine_urls(self, pool: str) -> set[str] | None:
        """URLs the router has in `pool` (None when the router cannot be asked)."""
        if not self.enabled:
            return None
        try:
            response = await self._http.get(f"{self.router_url}/admin/v1/engines", params={"pool": pool})
        except httpx.HTTPError:
            return None
        if response.status_code == 404:
            return set()
        if response.status_code != 200:
            return None
        return {engine["url"] for engine in response.json().get("engines", [])}

    async def close(self) -> None:
        await self._http.aclose()
