"""HTTP clients of what weight-sync drives: an engine's SGLang control endpoints and the router's admin API.

Only the calls of a weight update are here (docs/sglang-protocol.md §3): pause/continue, the three load endpoints,
/update_weight_version, /model_info, and the NCCL group calls. A refused call (non-2xx, or `success: false`)
raises EngineUpdateError with the engine's message; a connection failure or a timeout raises
EngineUnreachableError.

Timeouts: loads (and staging, the NCCL group calls) may legitimately take minutes on big models and get the
client's `timeout_s`; the control calls (pause, continue, version set and read) only wait on the engine's own
bookkeeping and get `control_timeout_s`, so a hung engine costs a failed update after seconds, not a load's limit.
Router calls get the client's timeout, a waiting drain its wait limit on top.

Both sides guard these calls with bearer tokens (miles.common.auth): engine requests carry the engines' admin API
key, except the version read (/model_info, an info route: SGLang opens it to the `api_key` alone when the engine
has one), which carries their api key when one is given; every router call carries the router's admin token (each
`""` where that side is open). A 401 or 403 names the setting that holds the token, so a misconfigured job says
what to fix.
"""

from __future__ import annotations

from typing import Any

import httpx

from miles.common.auth import bearer_headers
from miles.common.http_client import ENGINE_KEEPALIVE_EXPIRY_S, traced_async_client
from miles.weightsync.errors import EngineUnreachableError, EngineUpdateError


def _describe(response: httpx.Response) -> str:
    text = response.text[:500]
    return f"HTTP {response.status_code}: {text}"


class _JsonHttp:
    token_setting = ""
    """The setting that holds the token this side wants (named when it refuses ours)."""

    def __init__(self, base_url: str, timeout_s: float, *, bearer_token: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # Engines may be SGLang (uvicorn's 5 s keep-alive): idle connections go before the engine closes them.
        self._client = traced_async_client(
            base_url=self.base_url,
            timeout=timeout_s,
            keepalive_expiry_s=ENGINE_KEEPALIVE_EXPIRY_S,
            headers=bearer_headers(bearer_token),
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        check_success: bool = False,
        token: str = "",
        token_setting: str = "",
        timeout_s: float | None = None,
    ) -> Any:
        """One call. `token` replaces this client's own bearer token; a 401/403 names `token_setting` (default: the
        setting of this client's own token); `timeout_s` replaces the client's timeout."""
        headers = bearer_headers(token) or None
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            response = await self._client.request(method, path, json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise EngineUnreachableError(f"{method} {self.base_url}{path} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code // 100 != 2:
            refused = response.status_code in (401, 403)
            hint = f" (authentication failed: check {token_setting or self.token_setting})" if refused else ""
            error = EngineUpdateError(f"{method} {self.base_url}{path} answered {_describe(response)}{hint}")
            error.http_status_of_engine = response.status_code
            raise error
        payload = response.json() if response.content else None
        if check_success and not (isinstance(payload, dict) and payload.get("success") is True):
            raise EngineUpdateError(f"{method} {self.base_url}{path} did not succeed: {_describe(response)}")
        return payload


class EngineClient(_JsonHttp):
    """The control endpoints of one SGLang(-compatible) engine: `admin_api_key` goes with every request but the
    version read, which carries `api_key` when one is given (else the admin key: engines without an api key of
    their own leave that route open)."""

    token_setting = "engine_admin_api_key"

    staging_supported: bool | None = None
    """Whether the engine stages tensor updates (None: not asked yet)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        *,
        admin_api_key: str = "",
        api_key: str = "",
        control_timeout_s: float | None = None,
    ) -> None:
        """`timeout_s` bounds each load call, `control_timeout_s` (default: the same) each control call."""
        super().__init__(base_url, timeout_s, bearer_token=admin_api_key)
        self._api_key = api_key
        self.control_timeout_s = timeout_s if control_timeout_s is None else min(control_timeout_s, timeout_s)

    async def weight_version(self) -> str | None:
        """The version the engine reports (/model_info, else the deprecated /get_model_info); a refused token
        raises EngineUpdateError naming engine_api_key."""
        for path in ("/model_info", "/get_model_info"):
            try:
                info = await self.request(
                    "GET", path, token=self._api_key, token_setting="engine_api_key", timeout_s=self.control_timeout_s
                )
            except EngineUpdateError as exc:
                if exc.http_status_of_engine in (401, 403):
                    raise  # names engine_api_key: the engine has an api key of its own, not (or not this) one
                continue
            if isinstance(info, dict) and info.get("weight_version") is not None:
                return str(info["weight_version"])
        return None

    async def pause(self, mode: str) -> None:
        await self.request("POST", "/pause_generation", {"mode": mode}, timeout_s=self.control_timeout_s)

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", {}, timeout_s=self.control_timeout_s)

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> None:
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": False,
            "flush_cache": True,
        }
        await self.request("POST", "/update_weights_from_disk", body, check_success=True)

    async def update_weights_from_tensor(self, serialized: list[str], weight_version: str | None) -> None:
        body = {
            "serialized_named_tensors": serialized,
            "load_format": "safetensors",
            "weight_version": weight_version,
            "abort_all_requests": False,
            "flush_cache": True,
        }
        await self.request("POST", "/update_weights_from_tensor", body, check_success=True)

    async def stage_weights_from_tensor(self, serialized: list[str], stage_id: str) -> bool:
        """Hand the engine one batch to decode and hold (miles engines' /stage_weights_from_tensor) while it keeps
        serving. False when the engine has no such endpoint (stock SGLang: load under the pause instead)."""
        if self.staging_supported is False:
            return False
        body = {"serialized_named_tensors": serialized, "load_format": "safetensors", "stage_id": stage_id}
        try:
            await self.request("POST", "/stage_weights_from_tensor", body, check_success=True)
        except EngineUpdateError as exc:
            if exc.http_status_of_engine in (404, 405):
                self.staging_supported = False
                return False
            raise
        self.staging_supported = True
        return True

    async def apply_staged_weights(self, stage_id: str, weight_version: str | None) -> None:
        body = {
            "stage_id": stage_id,
            "weight_version": weight_version,
            "abort_all_requests": False,
            "flush_cache": True,
        }
        await self.request("POST", "/apply_staged_weights", body, check_success=True)

    async def update_weight_version(self, version: str) -> None:
        body = {"new_version": version, "abort_all_requests": False}
        await self.request("POST", "/update_weight_version", body, timeout_s=self.control_timeout_s)

    async def init_weights_update_group(self, body: dict[str, Any]) -> None:
        await self.request("POST", "/init_weights_update_group", body, check_success=True)

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> None:
        await self.request("POST", "/update_weights_from_distributed", body, check_success=True)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name}, check_success=True)


class RouterClient(_JsonHttp):
    """The rollout router's admin API (HTTP mirror of miles.router.v1.RouterAdminService) for one pool;
    `admin_token` goes with every call."""

    token_setting = "router_admin_token"

    def __init__(self, base_url: str, pool: str, timeout_s: float, *, admin_token: str = "") -> None:
        super().__init__(base_url, timeout_s, bearer_token=admin_token)
        self.pool = pool

    async def drain(self, engine_url: str, *, wait: bool, timeout_s: float) -> bool:
        """Stop new requests to the engine; with wait, until nothing is in flight (True) or timeout_s (False). The
        call itself may take timeout_s plus this client's timeout."""
        body = {"pool": self.pool, "url": engine_url, "wait": wait, "timeout_s": timeout_s}
        call_timeout_s = self.timeout_s + (timeout_s if wait else 0.0)
        payload = await self.request("POST", "/admin/v1/engines/drain", body, timeout_s=call_timeout_s)
        return bool(payload.get("drained")) if isinstance(payload, dict) else False

    async def undrain(self, engine_url: str) -> None:
        await self.request("POST", "/admin/v1/engines/undrain", {"pool": self.pool, "url": engine_url})

    async def list_engines(self) -> list[dict[str, Any]]:
        payload = await self.request("GET", f"/admin/v1/engines?pool={self.pool}")
        engines = payload.get("engines", []) if isinstance(payload, dict) else []
        return [engine for engine in engines if isinstance(engine, dict)]
