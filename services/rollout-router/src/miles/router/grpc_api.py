"""gRPC transport of RouterAdminService (protos/miles/router/v1/router.proto): translate, call RouterAdmin."""

from __future__ import annotations

import grpc

from miles.common.contracts.weight_version import UNKNOWN_WEIGHT_VERSION
from miles.proto.router.v1 import router_pb2, router_pb2_grpc
from miles.router.admin import RouterAdmin
from miles.router.engine import EngineSource, EngineState
from miles.router.snapshots import EngineSnapshot

SERVICE_NAME = "miles.router.v1.RouterAdminService"

_STATE = {
    EngineState.HEALTHY: router_pb2.ENGINE_STATE_HEALTHY,
    EngineState.UNHEALTHY: router_pb2.ENGINE_STATE_UNHEALTHY,
    EngineState.DRAINING: router_pb2.ENGINE_STATE_DRAINING,
    EngineState.DRAINED: router_pb2.ENGINE_STATE_DRAINED,
}
_SOURCE = {
    EngineSource.STATIC: router_pb2.ENGINE_SOURCE_STATIC,
    EngineSource.ADMIN: router_pb2.ENGINE_SOURCE_ADMIN,
    EngineSource.KUBERNETES: router_pb2.ENGINE_SOURCE_KUBERNETES,
}


def engine_info(snapshot: EngineSnapshot) -> router_pb2.EngineInfo:
    return router_pb2.EngineInfo(
        pool=snapshot.pool,
        url=snapshot.url,
        state=_STATE[snapshot.state],
        weight_version=snapshot.weight_version if snapshot.weight_version is not None else UNKNOWN_WEIGHT_VERSION,
        in_flight=snapshot.in_flight,
        queued=snapshot.queued,
        max_concurrency=snapshot.max_concurrency,
        num_sticky_keys=snapshot.num_sticky_keys,
        source=_SOURCE[snapshot.source],
        queued_tokens=snapshot.queued_tokens,
        circuit_open=snapshot.circuit_open,
        kv_capacity_tokens=snapshot.kv_capacity_tokens or 0,
        cache_tree_tokens=snapshot.cache_tree_tokens,
        admit_at_weight_version=snapshot.admit_at_version or 0,
    )


class RouterAdminServicer(router_pb2_grpc.RouterAdminServiceServicer):
    def __init__(self, admin: RouterAdmin) -> None:
        self.admin = admin

    async def RegisterEngine(
        self, request: router_pb2.RegisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterEngineResponse:
        snapshot = await self.admin.register_engine(request.pool, request.url, request.max_concurrency)
        return router_pb2.RegisterEngineResponse(engine=engine_info(snapshot))

    async def DeregisterEngine(
        self, request: router_pb2.DeregisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterEngineResponse:
        return router_pb2.DeregisterEngineResponse(removed=self.admin.deregister_engine(request.pool, request.url))

    async def DrainEngine(
        self, request: router_pb2.DrainEngineRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DrainEngineResponse:
        result = await self.admin.drain_engine(request.pool, request.url, request.wait, request.timeout_s)
        return router_pb2.DrainEngineResponse(engine=engine_info(result.engine), drained=result.drained)

    async def UndrainEngine(
        self, request: router_pb2.UndrainEngineRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.UndrainEngineResponse:
        snapshot = await self.admin.undrain_engine(request.pool, request.url)
        return router_pb2.UndrainEngineResponse(engine=engine_info(snapshot))

    async def ListEngines(
        self, request: router_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListEnginesResponse:
        return router_pb2.ListEnginesResponse(engines=[engine_info(s) for s in self.admin.list_engines(request.pool)])

    async def Stats(
        self, request: router_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StatsResponse:
        stats = self.admin.stats(request.pool)
        return router_pb2.StatsResponse(
            pool=stats.pool,
            policy=stats.policy,
            requests_total=stats.requests_total,
            retries_total=stats.retries_total,
            failures_total=stats.failures_total,
            sticky_hits_total=stats.sticky_hits_total,
            sticky_misses_total=stats.sticky_misses_total,
            prompt_tokens_total=stats.prompt_tokens_total,
            cached_tokens_total=stats.cached_tokens_total,
            prefix_hit_rate=stats.prefix_hit_rate,
            sticky_new_keys_total=stats.sticky_new_keys_total,
            backpressure_total=stats.backpressure_total,
            version_conflicts_total=stats.version_conflicts_total,
            num_engines=stats.num_engines,
            num_healthy_engines=stats.num_healthy_engines,
        )
