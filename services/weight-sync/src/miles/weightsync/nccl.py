"""The nccl transport: SGLang's /init_weights_update_group + /update_weights_from_distributed, driven from the
trainer process that holds the tensors (on GPUs: NCCL; on the CPU: gloo, for tests).

Per engine (so updates can roll engine by engine, version-locked like the other transports) the trainer is rank
0 of a group `<group_name>-<index>` with the engine's ranks 1..engine_world_size, rendezvous at
tcp://master_address:(master_port + index). The group is created once, on the engine's first load: the trainer
POSTs /init_weights_update_group {master_address, master_port, rank_offset: 1, world_size, group_name, backend}
and joins the rendezvous at the same time (both sides block until everyone is in). Each load then sends, per
bucket of at most `bucket_bytes`, POST /update_weights_from_distributed {names, dtypes (torch names without
"torch."), shapes, group_name, flush_cache: false, abort_all_requests: false, weight_version} and, while that
request is pending, broadcasts the bucket's tensors from rank 0 in the listed order. `close()` POSTs
/destroy_weights_update_group and destroys the local groups.

The process-group creation is SGLang's `init_custom_process_group` (a store prefixed with the group name,
torch's `_new_process_group_helper`), shared with the miles engine in `miles.model.update_group` (re-exported
here), so the trainer side meets real SGLang engines and miles engines alike; it needs no default process
group. Limits: one engine rank per engine is what the tests exercise (engine_world_size > 1 is passed through
unchanged); tensors must already be in the engine dtype. NCCL broadcasts GPU memory only: with `device` set
(`cuda:N`), each tensor is copied there just before its broadcast, one at a time, so CPU snapshots (the trainer's
publisher keeps them) cost at most one tensor of GPU memory beyond the weights; without it tensors go as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from miles.common.ports import free_port
from miles.model.update_group import init_custom_process_group as init_custom_process_group
from miles.weightsync.engine_client import EngineClient
from miles.weightsync.transports import LoadResult, PreparedLoad, WeightTransport


@dataclass(frozen=True)
class NcclConfig:
    master_address: str
    """Address of the trainer rank that drives the update, as the engines can reach it."""
    master_port: int
    """Rendezvous port of the first engine's group; group i uses master_port + i. 0: each group takes a port that
    is free on this host when it is created (the engines must be allowed to reach any port of the trainer)."""
    group_name: str = "miles-weight-update"
    backend: str = "nccl"
    """nccl on GPUs; gloo for CPU tests."""
    bucket_bytes: int = 512 << 20
    engine_world_size: int = 1
    """Ranks of one engine (its tensor-parallel size)."""
    timeout_s: float = 300.0
    device: str = ""
    """Where broadcast tensors must be: "" = where they are (gloo: the CPU); "cuda:N" for nccl (see the doc)."""


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def buckets(named: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    result: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    filled = 0
    for name, tensor in named.items():
        size = tensor.numel() * tensor.element_size()
        if current and filled + size > bucket_bytes:
            result.append(current)
            current, filled = [], 0
        current.append((name, tensor))
        filled += size
    if current:
        result.append(current)
    return result


@dataclass
class _Group:
    name: str
    process_group: Any


class NcclTransport(WeightTransport):
    """Broadcasts the trainer's tensors of version v to one engine over its weight-update group."""

    name = "nccl"

    def __init__(self, config: NcclConfig, weights_of: Callable[[int], Mapping[str, Any]]) -> None:
        self.config = config
        self.weights_of = weights_of
        self._groups: dict[str, _Group] = {}
        self._engines: dict[str, EngineClient] = {}
        self._next_index = 0  # never reused: a forgotten group's rendezvous port may still be held

    async def _group(self, engine: EngineClient) -> _Group:
        existing = self._groups.get(engine.base_url)
        if existing is not None:
            return existing
        index = self._next_index
        self._next_index += 1
        cfg = self.config
        name = f"{cfg.group_name}-{index}"
        # master_port 0: one rendezvous port per group, free on every interface of this host right now
        port = cfg.master_port + index if cfg.master_port else free_port("")
        body = {
            "master_address": cfg.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": 1 + cfg.engine_world_size,
            "group_name": name,
            "backend": cfg.backend,
        }
        request = asyncio.create_task(engine.init_weights_update_group(body))
        process_group = await asyncio.to_thread(
            init_custom_process_group,
            cfg.backend,
            f"tcp://{cfg.master_address}:{port}",
            1 + cfg.engine_world_size,
            0,
            name,
            cfg.timeout_s,
        )
        await request
        group = self._groups[engine.base_url] = _Group(name, process_group)
        self._engines[engine.base_url] = engine
        return group

    async def apply(self, engine: EngineClient, prepared: PreparedLoad) -> LoadResult:
        """Broadcast every tensor of the version; the last bucket sets the version label and flushes the prefix
        cache (KV computed with the old weights must not serve the new ones). A failure forgets the engine's
        group (the engine may have restarted without it), so the next load creates a new one."""
        version = prepared.version
        group = await self._group(engine)
        named = self.weights_of(version)
        num_bytes = 0
        all_buckets = buckets(named, self.config.bucket_bytes)
        try:
            for index, bucket in enumerate(all_buckets):
                last = index == len(all_buckets) - 1
                body = {
                    "names": [name for name, _ in bucket],
                    "dtypes": [torch_dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": group.name,
                    "flush_cache": last,
                    "abort_all_requests": False,
                    "weight_version": str(version) if last else None,
                }
                request = asyncio.create_task(engine.update_weights_from_distributed(body))
                await asyncio.to_thread(_broadcast, group, [t for _, t in bucket], self.config.device)
                await request
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        except BaseException:
            self._forget(engine.base_url)
            raise
        return LoadResult(None, "full", num_bytes)

    def _forget(self, engine_url: str) -> None:
        group = self._groups.pop(engine_url, None)
        self._engines.pop(engine_url, None)
        if group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group.process_group)

    async def close(self) -> None:
        for url, group in self._groups.items():
            await self._engines[url].destroy_weights_update_group(group.name)
            dist.destroy_process_group(group.process_group)
        self._groups.clear()


def _broadcast(group: _Group, tensors: list[torch.Tensor], device: str) -> None:
    """Broadcast from rank 0, in order; runs in a worker thread, whose current CUDA device is not the trainer's
    (torch keeps it per thread), hence the guard."""
    guard = torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()
    with guard:
        for tensor in tensors:
            placed = tensor.to(device) if device else tensor
            dist.broadcast(placed.contiguous(), src=0, group=group.process_group)
