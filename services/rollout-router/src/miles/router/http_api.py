"""HTTP transport: the data plane (SGLang-native routes, bytes passed through) and the admin API mirror.

Data plane: `POST /generate` (also `PUT`, as SGLang accepts), `POST /v1/chat/completions`,
`POST /v1/completions`. The body is read whole and handed to the forwarder untouched; the engine's status,
headers (less hop-by-hop ones) and body come back unchanged. Router decisions that are errors (no pool or engine
503, version 409, backpressure 429 + Retry-After, invalid routing header 400) use the shared JSON error body
`{"error": {"type", "code", "message", ...}}`. Any other path is 404.

`GET /v1/weight_version?pool=` (read-only, no auth like the data plane) answers the weight versions the pool's
available engines serve: a barrier-synchronous rollout worker waits on it for the next version before starting a
batch (miles.rollout.barrier).

Admin mirror of RouterAdminService under /admin/v1/ (JSON, field names as in the proto; `state` and `source`
as lower-case names). Every admin route needs `Authorization: Bearer <admin_token>` when the router has one (401
without a token, 403 with another); the data plane, /healthz, /readyz and /metrics never do. What each route
answers is declared in openapi_docs.py.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from miles.common.auth import AUTH_RESPONSES
from miles.common.contracts.weight_version import UNKNOWN_WEIGHT_VERSION
from miles.common.http import create_http_app
from miles.common.telemetry import Metrics
from miles.router.core import RouterService
from miles.router.forwarder import ForwardedResponse
from miles.router.openapi_docs import (
    ADMIN_ENGINE_RESPONSES,
    ADMIN_REGISTER_RESPONSES,
    ADMIN_STATS_RESPONSES,
    CHAT_OPENAPI,
    COMPLETIONS_OPENAPI,
    DATA_PLANE_RESPONSES,
    ENGINE_URL_PATTERN,
    GENERATE_OPENAPI,
    REGISTER_EXAMPLES,
)
from miles.router.relay import StreamRelay
from miles.router.routing_input import ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_GENERATE
from miles.router.snapshots import EngineSnapshot, PoolStatsSnapshot


class _PassthroughResponse(Response):
    """A complete engine answer with the engine's headers, byte for byte."""

    def __init__(self, forwarded: ForwardedResponse) -> None:
        body = forwarded.body or b""
        super().__init__(content=body, status_code=forwarded.status_code)
        self.raw_headers = [*_raw(forwarded.headers), (b"content-length", str(len(body)).encode())]


class _RelayResponse(StreamingResponse):
    """A streamed engine answer; the relay is closed (slot released, outcome recorded) whatever happens."""

    def __init__(self, forwarded: ForwardedResponse, relay: StreamRelay) -> None:
        super().__init__(content=relay, status_code=forwarded.status_code)
        self.relay = relay
        self.raw_headers = _raw(forwarded.headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.aclose()


def _raw(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]


def data_plane_router(service: RouterService) -> APIRouter:
    router = APIRouter(tags=["data plane"])

    async def proxy(request: Request, route: str) -> Response:
        body = await request.body()
        forwarded = await service.forwarder.forward(route, request.method, request.headers, body)
        if forwarded.stream is not None:
            return _RelayResponse(forwarded, forwarded.stream)
        return _PassthroughResponse(forwarded)

    # One route per method (not api_route with methods=[...]): each gets its own OpenAPI operationId.
    generate_doc: dict[str, Any] = {"responses": DATA_PLANE_RESPONSES, "openapi_extra": GENERATE_OPENAPI}

    @router.post(ROUTE_GENERATE, summary="SGLang /generate, routed to one engine", **generate_doc)
    @router.put(ROUTE_GENERATE, summary="SGLang /generate, routed to one engine", **generate_doc)
    async def generate(request: Request) -> Response:
        return await proxy(request, ROUTE_GENERATE)

    @router.post(
        ROUTE_CHAT,
        summary="OpenAI chat completions, routed to one engine",
        responses=DATA_PLANE_RESPONSES,
        openapi_extra=CHAT_OPENAPI,
    )
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, ROUTE_CHAT)

    @router.post(
        ROUTE_COMPLETIONS,
        summary="OpenAI completions, routed to one engine",
        responses=DATA_PLANE_RESPONSES,
        openapi_extra=COMPLETIONS_OPENAPI,
    )
    async def completions(request: Request) -> Response:
        return await proxy(request, ROUTE_COMPLETIONS)

    @router.get("/v1/weight_version", summary="Weight versions the pool's available engines serve")
    async def weight_version(
        pool: Annotated[str, Query(description='"" = the default pool')] = "",
    ) -> PoolWeightVersion:
        return PoolWeightVersion.of(pool, service.admin.served_versions(pool))

    return router


class PoolWeightVersion(BaseModel):
    pool: str
    min_weight_version: int | None
    """Lowest version among the available engines: every request is served at this version or newer. null when
    no engine is available or one's version is not known yet."""
    max_weight_version: int | None
    """Highest known version among them (null when none is known)."""
    num_available_engines: int
    """Engines taking requests now (healthy, not drained, not paused, circuit closed)."""

    @classmethod
    def of(cls, pool: str, versions: list[int | None]) -> PoolWeightVersion:
        known = [version for version in versions if version is not None]
        complete = bool(versions) and len(known) == len(versions)
        return cls(
            pool=pool,
            min_weight_version=min(known) if complete else None,
            max_weight_version=max(known) if known else None,
            num_available_engines=len(versions),
        )


# --- admin mirror -------------------------------------------------------------------------------------------------
class EngineRef(BaseModel):
    pool: str = ""
    """Pool name; "" = the router's default pool."""
    url: str = Field(json_schema_extra={"pattern": ENGINE_URL_PATTERN})
    """Engine base URL, e.g. http://10.0.0.5:30000 (400 when not http(s) with a host)."""


class RegisterEngineBody(EngineRef):
    max_concurrency: int = Field(default=0, ge=0)
    """0 = the engine's reported max_running_requests, else the router default."""


class DrainEngineBody(EngineRef):
    wait: bool = False
    """Return only once nothing is in flight or queued (or timeout_s passed)."""
    timeout_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Wait limit, seconds (0 = the router's drain_timeout_s)."""


class EngineInfoModel(BaseModel):
    pool: str
    url: str
    state: str
    source: str
    weight_version: int
    """-1 when unknown."""
    in_flight: int
    queued: int
    queued_tokens: int
    max_concurrency: int
    num_sticky_keys: int
    circuit_open: bool
    kv_capacity_tokens: int
    cache_tree_tokens: int
    admit_at_weight_version: int = 0
    """> 0 while joining: no requests (state unhealthy) until the engine reports this weight version."""

    @classmethod
    def of(cls, snapshot: EngineSnapshot) -> EngineInfoModel:
        return cls(
            pool=snapshot.pool,
            url=snapshot.url,
            state=snapshot.state.value,
            source=snapshot.source.value,
            weight_version=snapshot.weight_version if snapshot.weight_version is not None else UNKNOWN_WEIGHT_VERSION,
            in_flight=snapshot.in_flight,
            queued=snapshot.queued,
            queued_tokens=snapshot.queued_tokens,
            max_concurrency=snapshot.max_concurrency,
            num_sticky_keys=snapshot.num_sticky_keys,
            circuit_open=snapshot.circuit_open,
            kv_capacity_tokens=snapshot.kv_capacity_tokens or 0,
            cache_tree_tokens=snapshot.cache_tree_tokens,
            admit_at_weight_version=snapshot.admit_at_version or 0,
        )


class EngineResponse(BaseModel):
    engine: EngineInfoModel


class DeregisterResponse(BaseModel):
    removed: bool


class DrainResponse(BaseModel):
    engine: EngineInfoModel
    drained: bool


class ListEnginesResponse(BaseModel):
    engines: list[EngineInfoModel]


class StatsResponse(BaseModel):
    pool: str
    policy: str
    requests_total: int
    retries_total: int
    failures_total: int
    sticky_hits_total: int
    sticky_misses_total: int
    sticky_new_keys_total: int
    backpressure_total: int
    version_conflicts_total: int
    prompt_tokens_total: int
    cached_tokens_total: int
    prefix_hit_rate: float
    num_engines: int
    num_healthy_engines: int

    @classmethod
    def of(cls, stats: PoolStatsSnapshot) -> StatsResponse:
        return cls(
            pool=stats.pool,
            policy=stats.policy,
            requests_total=stats.requests_total,
            retries_total=stats.retries_total,
            failures_total=stats.failures_total,
            sticky_hits_total=stats.sticky_hits_total,
            sticky_misses_total=stats.sticky_misses_total,
            sticky_new_keys_total=stats.sticky_new_keys_total,
            backpressure_total=stats.backpressure_total,
            version_conflicts_total=stats.version_conflicts_total,
            prompt_tokens_total=stats.prompt_tokens_total,
            cached_tokens_total=stats.cached_tokens_total,
            prefix_hit_rate=stats.prefix_hit_rate,
            num_engines=stats.num_engines,
            num_healthy_engines=stats.num_healthy_engines,
        )


def admin_router(service: RouterService) -> APIRouter:
    router = APIRouter(
        prefix="/admin/v1",
        tags=["admin"],
        dependencies=[Depends(service.admin_auth.http_dependency)],
        responses=AUTH_RESPONSES,
    )
    admin = service.admin

    @router.post("/engines", summary="RegisterEngine", responses=ADMIN_REGISTER_RESPONSES)
    async def register_engine(
        body: Annotated[RegisterEngineBody, Body(openapi_examples=REGISTER_EXAMPLES)],
    ) -> EngineResponse:
        snapshot = await admin.register_engine(body.pool, body.url, body.max_concurrency)
        return EngineResponse(engine=EngineInfoModel.of(snapshot))

    @router.post("/engines/deregister", summary="DeregisterEngine", responses=ADMIN_ENGINE_RESPONSES)
    async def deregister_engine(body: EngineRef) -> DeregisterResponse:
        return DeregisterResponse(removed=admin.deregister_engine(body.pool, body.url))

    @router.post("/engines/drain", summary="DrainEngine", responses=ADMIN_ENGINE_RESPONSES)
    async def drain_engine(body: DrainEngineBody) -> DrainResponse:
        result = await admin.drain_engine(body.pool, body.url, body.wait, body.timeout_s)
        return DrainResponse(engine=EngineInfoModel.of(result.engine), drained=result.drained)

    @router.post("/engines/undrain", summary="UndrainEngine", responses=ADMIN_ENGINE_RESPONSES)
    async def undrain_engine(body: EngineRef) -> EngineResponse:
        return EngineResponse(engine=EngineInfoModel.of(await admin.undrain_engine(body.pool, body.url)))

    @router.get("/engines", summary="ListEngines")
    async def list_engines(pool: Annotated[str, Query(description='"" = every pool')] = "") -> ListEnginesResponse:
        return ListEnginesResponse(engines=[EngineInfoModel.of(s) for s in admin.list_engines(pool)])

    @router.get("/stats", summary="Stats", responses=ADMIN_STATS_RESPONSES)
    async def stats(pool: Annotated[str, Query(description='"" = the default pool')] = "") -> StatsResponse:
        return StatsResponse.of(admin.stats(pool))

    return router


def create_app(service: RouterService, metrics: Metrics) -> FastAPI:
    """The router's FastAPI app (probes and metrics from miles.common)."""
    app = create_http_app(
        service="router",
        metrics=metrics,
        readiness_checks={"discovery": service.check_ready},
        title="miles-rollout-router",
    )
    app.include_router(data_plane_router(service))
    app.include_router(admin_router(service))
    return app
