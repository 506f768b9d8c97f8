"""What the local backend reads of a running job: the trainer's Status (gRPC) and counters of the workers' /metrics.

One gRPC channel per job's trainer, opened on first use (inside the running event loop) and closed when the job
stops. When the trainer does not answer (restarting), the last Status seen is returned, so progress never goes
backwards in the controller's view.
"""

from __future__ import annotations

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from miles.common.grpc_client import create_channel
from miles.proto.trainer.v1 import trainer_pb2, trainer_pb2_grpc

TITO_CRITICAL_METRIC = "miles_rollout_tito_critical_episodes_total"
"""Rollout-worker counter of episodes whose token buffer differed critically from a fresh render."""


class StatusReaders:
    def __init__(self, http: httpx.AsyncClient, *, trainer_token: str = "", status_timeout_s: float = 5.0) -> None:
        self._http = http
        self.trainer_token = trainer_token
        self.status_timeout_s = status_timeout_s
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}
        self._last_status: dict[str, trainer_pb2.StatusResponse] = {}

    async def trainer_status(self, job_id: str, address: str) -> trainer_pb2.StatusResponse | None:
        """The job's trainer Status (the last one seen when it does not answer right now; None before any)."""
        cached = self._channels.get(job_id)
        if cached is None or cached[0] != address:
            await self._close_channel(job_id)
            cached = (address, create_channel(address, bearer_token=self.trainer_token))
            self._channels[job_id] = cached
        stub = trainer_pb2_grpc.TrainerServiceStub(cached[1])  # type: ignore[no-untyped-call]
        try:
            status: trainer_pb2.StatusResponse = await stub.Status(
                trainer_pb2.StatusRequest(), timeout=self.status_timeout_s
            )
        except grpc.aio.AioRpcError:
            return self._last_status.get(job_id)
        self._last_status[job_id] = status
        return status

    async def counter_sum(self, base_urls: list[str], metric: str) -> float | None:
        """`metric` (a sample name, e.g. `..._total`) summed over the /metrics of `base_urls` (None: no answer)."""
        total: float | None = None
        for base_url in base_urls:
            try:
                response = await self._http.get(f"{base_url}/metrics")
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                continue
            for family in text_string_to_metric_families(response.text):
                for sample in family.samples:
                    if sample.name == metric:
                        total = (total or 0.0) + float(sample.value)
        return total

    async def forget(self, job_id: str) -> None:
        self._last_status.pop(job_id, None)
        await self._close_channel(job_id)

    async def close(self) -> None:
        for job_id in list(self._channels):
            await self.forget(job_id)

    async def _close_channel(self, job_id: str) -> None:
        cached = self._channels.pop(job_id, None)
        if cached is not None:
            await cached[1].close()
