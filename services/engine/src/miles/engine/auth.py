"""Which key each engine route needs: SGLang's `--api-key` / `--admin-api-key` semantics
(python/sglang/srt/utils/auth.py), with miles' bearer-token checks (miles.common.auth).

- Always open: /health and /health_generate (SGLang: `/health*`) and the probes every miles service serves
  (/healthz, /readyz, /metrics), for Kubernetes and Prometheus: they are declared outside the guarded routes.
- Control routes (`CONTROL_PATHS`, SGLang's "admin-optional" routes: every route that changes the engine's state):
  the `admin_api_key` when one is set, else the `api_key`, else open.
- Every other route (generation, model and server info, loads): the `api_key` when one is set, else open. The
  admin key alone does not open them, as in SGLang.

No token → 401, a token that is not accepted → 403, with the common error body `{"error": {...}}` (SGLang answers
401 `{"error": "Unauthorized"}` to both; callers only look at the status).

Limits: a path outside the guarded routes (404) is answered without a token check; a control route must be
listed here by path, whatever its HTTP method, or it is guarded by the api_key only (a test lists every route
that is not a plain read and fails when one is missing).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from miles.common.auth import BearerAuth
from miles.engine.settings import EngineSettings

CONTROL_PATHS = frozenset(
    {
        "/flush_cache",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weight_version",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/stage_weights_from_tensor",
        "/apply_staged_weights",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/weights_checker",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)
"""Routes that need the admin key (else the api key): pauses, aborts, cache and memory control, weight updates,
LoRA adapter loads and unloads."""


@dataclass(frozen=True)
class EngineAuth:
    api: BearerAuth
    """Generation and info routes: the api_key (no key: open)."""
    control: BearerAuth
    """CONTROL_PATHS: the admin_api_key, else the api_key (neither: open)."""

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> EngineAuth:
        api_key = settings.api_key.get_secret_value()
        admin_key = settings.admin_api_key.get_secret_value()
        return cls(
            api=BearerAuth([api_key], what="the engine API"),
            control=BearerAuth([admin_key or api_key], what="the engine's control routes"),
        )

    async def http_dependency(self, request: Request) -> None:
        """FastAPI dependency of every guarded route. The key is picked by the matched route's declared path (the
        request's own path may carry a root_path prefix); without a matched route the stricter control key."""
        path = getattr(request.scope.get("route"), "path", None)
        guard = self.api if path is not None and path not in CONTROL_PATHS else self.control
        guard.check(request.headers.get("authorization"))
