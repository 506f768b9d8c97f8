"""The controller's calls to the shared services for one job: register it before its resources start, read its
per-job statistics while it runs, unregister it when it is deleted.

- session server: `PUT /v1/jobs/{id}/config` (model path, TITO family, chat template kwargs, the router pool =
  the job id or its shared pool (then `lora_adapter: true`: every request names the job's adapter),
  `record_routing` = `train.routing_replay` when set, `roles` and `tree_sessions` from the rollout
  section when set) with the operator token; it answers the config it stored, whose `record_routing` (resolved
  from the model when unset) `register` returns for the job's engines.
  `DELETE` of it on job deletion. Each of the job's inference pools gets a config of its own,
  `<job id>--<pool name>`, naming its model and its router pool (sessions of a judge or a teacher).
- buffer: gRPC `ConfigureJob` (the job's queue, created before any worker pushes) and `DeleteJob`.
- router: `GET /admin/v1/stats?pool=<job id>` for the job's prefix hit rate (counters of the replica that answers:
  with several router replicas this is one replica's view).

An empty address skips that service (tests and partial local stacks). Every call is idempotent, so the supervisor
simply repeats registration after a controller restart. Failures raise MilesErrors (UnavailableError when the
service cannot be reached: the supervisor retries).
"""

from __future__ import annotations

from typing import Any

import grpc
import httpx

from miles.common.auth import bearer_headers
from miles.common.errors import MilesError, UnavailableError, error_class_for_http_status
from miles.common.grpc_client import create_channel, error_from_rpc_error
from miles.common.http_client import traced_async_client
from miles.common.jobspec.job import JobSpec
from miles.common.jobspec.pools import inference_pool_router_name
from miles.controller.backends.base import SharedServices
from miles.controller.routing_replay import session_record_routing
from miles.proto.buffer.v1 import buffer_pb2, buffer_pb2_grpc

_STALE_POLICIES = {"mask": buffer_pb2.STALE_POLICY_MASK, "drop": buffer_pb2.STALE_POLICY_DROP}
"""TrainConfig.stale_policy -> the buffer's policy for the job's groups over max_staleness."""


def engine_pool_of(job_id: str, spec: JobSpec) -> str:
    """The router pool of a job's engines (the same name on every backend): the job id, or the shared pool a LoRA
    job runs on."""
    return spec.resources.engines.shared_pool or job_id


def _session_roles(spec: JobSpec) -> dict[str, Any]:
    """The multi-agent fields of the session server's job config, only where the spec sets them: a job without
    roles or tree sessions registers the same body as before, so a session server older than them accepts it."""
    fields: dict[str, Any] = {}
    if spec.rollout.roles:
        fields["roles"] = list(spec.rollout.roles)
    if spec.rollout.tree_sessions:
        fields["tree_sessions"] = True
    return fields


class SharedServicesClient:
    """Clients of the session server, buffer and router; one per controller process."""

    def __init__(self, shared: SharedServices, *, timeout_s: float) -> None:
        self.shared = shared
        self.timeout_s = timeout_s
        self._http = traced_async_client(timeout=timeout_s)
        self._router_headers = bearer_headers(shared.tokens.router_admin)
        self._channel: grpc.aio.Channel | None = None
        self._buffer_stub: Any = None

    @property
    def _buffer(self) -> Any:
        """The buffer stub, its channel created on first use: a grpc.aio channel binds to the running event loop,
        and the controller is built before `asyncio.run` starts the loop that serves it."""
        if self._buffer_stub is None and self.shared.buffer_address:
            self._channel = create_channel(self.shared.buffer_address, bearer_token=self.shared.tokens.buffer_operator)
            self._buffer_stub = buffer_pb2_grpc.BufferServiceStub(self._channel)  # type: ignore[no-untyped-call]
        return self._buffer_stub

    async def close(self) -> None:
        await self._http.aclose()
        if self._channel is not None:
            await self._channel.close()

    async def register(self, job_id: str, spec: JobSpec) -> bool | None:
        """Session-server job config, then the buffer's job queue (both idempotent). Returns the session server's
        resolved `record_routing` (whether the job records MoE routing); None without a session server or when its
        answer does not say (a session server older than R3)."""
        record_routing: bool | None = None
        if self.shared.session_url:
            body = {
                "model_path": spec.model.path,
                "model_family": spec.model.family,
                "engine_pool": engine_pool_of(job_id, spec),
                "chat_template_kwargs": spec.model.chat_template_kwargs,
                **({"lora_adapter": True} if spec.resources.engines.shared_pool else {}),
                **session_record_routing(spec),
                **_session_roles(spec),
            }
            stored = await self._session_call("PUT", job_id, body)
            resolved = stored.get("record_routing")
            record_routing = resolved if isinstance(resolved, bool) else None
            for pool in spec.inference_pools:  # a judge's or teacher's sessions run on that pool's engines
                pool_id = inference_pool_router_name(job_id, pool.name)
                pool_body = {
                    "model_path": pool.model_path,
                    "model_family": pool.model_family,
                    "engine_pool": pool_id,
                    "chat_template_kwargs": pool.chat_template_kwargs,
                }
                await self._session_call("PUT", pool_id, pool_body)
        if self._buffer is not None:
            config = buffer_pb2.JobBufferConfig(stale_policy=_STALE_POLICIES[spec.train.effective_stale_policy])
            request = buffer_pb2.ConfigureJobRequest(job_id=job_id, config=config)
            await self._grpc(self._buffer.ConfigureJob, request)
        return record_routing

    async def unregister(self, job_id: str, spec: JobSpec) -> None:
        """Remove the job's session configs (its own and its inference pools') and buffer queue (nothing there is
        fine)."""
        if self.shared.session_url:
            await self._session_call("DELETE", job_id, None, missing_ok=True)
            for pool in spec.inference_pools:
                await self._session_call("DELETE", inference_pool_router_name(job_id, pool.name), None, missing_ok=True)
        if self._buffer is not None:
            await self._grpc(self._buffer.DeleteJob, buffer_pb2.DeleteJobRequest(job_id=job_id))

    async def router_stats(self, job_id: str, spec: JobSpec) -> dict[str, float]:
        """`prefix_hit_rate` (and the token counters) of the job's engine pool; {} when unknown. (A shared pool's
        are the whole pool's, every job on it together.)"""
        if not self.shared.router_url:
            return {}
        url = f"{self.shared.router_url.rstrip('/')}/admin/v1/stats"
        try:
            params = {"pool": engine_pool_of(job_id, spec)}
            response = await self._http.get(url, params=params, headers=self._router_headers)
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        stats: dict[str, Any] = response.json()
        wanted = ("prefix_hit_rate", "prompt_tokens_total", "cached_tokens_total", "num_healthy_engines")
        return {key: float(stats[key]) for key in wanted if isinstance(stats.get(key), (int, float))}

    async def _session_call(
        self, method: str, job_id: str, body: dict[str, Any] | None, *, missing_ok: bool = False
    ) -> dict[str, Any]:
        """The answer's JSON object ({} for an empty body, a 204, a 404 with `missing_ok`, or a non-object)."""
        url = f"{self.shared.session_url.rstrip('/')}/v1/jobs/{job_id}/config"
        headers = bearer_headers(self.shared.session_operator_token)
        try:
            response = await self._http.request(method, url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise UnavailableError(
                f"session server unreachable at {self.shared.session_url}: {type(exc).__name__}: {exc}",
                retry_after_s=2.0,
            ) from exc
        if missing_ok and response.status_code == 404:
            return {}
        if response.status_code < 300:
            try:
                answer = response.json() if response.content else {}
            except ValueError:
                return {}
            return answer if isinstance(answer, dict) else {}
        error_class = error_class_for_http_status(response.status_code)
        raise error_class(f"session server answered {response.status_code} to {method} {url}: {response.text[:300]}")

    async def _grpc(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            error: MilesError = error_from_rpc_error(exc)
            raise error from exc
