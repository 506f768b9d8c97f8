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

The process-group creation mirrors SGLang's `init_custom_process_group` (a store prefixed with the group name,
torch's `_new_process_group_helper`), so the trainer side meets real SGLang engines; it needs no default
process group. Limits: one engine rank per engine is what the tests exercise (engine_world_size > 1 is passed
through unchanged); tensors must already be in the engine dtype and on `device`.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from miles.weightsync.engine_client import EngineClient
from miles.weightsync.transports import LoadResult, WeightTransport
from miles.weightsync.weights import WeightSet


@dataclass(frozen=True)
class NcclConfig:
    master_address: str
    """Address of the trainer rank that drives the update, as the engines can reach it."""
    master_port: int
    """Rendezvous port of the first engine's group; engine i uses master_port + i."""
    group_name: str = "miles-weight-update"
    backend: str = "nccl"
    """nccl on GPUs; gloo for CPU tests."""
    bucket_bytes: int = 512 << 20
    engine_world_size: int = 1
    """Ranks of one engine (its tensor-parallel size)."""
    timeout_s: float = 300.0


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float
) -> Any:
    """A process group outside the default one, built the way SGLang builds its weight-update group."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        prefixed,
        group_name=c10d.GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


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

    async def _group(self, engine: EngineClient) -> _Group:
        existing = self._groups.get(engine.base_url)
        if existing is not None:
            return existing
        index = len(self._groups)
        cfg = self.config
        name = f"{cfg.group_name}-{index}"
        port = cfg.master_port + index
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

    async def load(self, engine: EngineClient, version: int, current: WeightSet | None) -> LoadResult:
        group = await self._group(engine)
        named = self.weights_of(version)
        num_bytes = 0
        for bucket in buckets(named, self.config.bucket_bytes):
            body = {
                "names": [name for name, _ in bucket],
                "dtypes": [torch_dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": group.name,
                "flush_cache": False,
                "abort_all_requests": False,
                "weight_version": str(version),
            }
            request = asyncio.create_task(engine.update_weights_from_distributed(body))
            await asyncio.to_thread(self._broadcast, group, [t for _, t in bucket])
            await request
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        return LoadResult(None, "full", num_bytes)

    @staticmethod
    def _broadcast(group: _Group, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            dist.broadcast(tensor.contiguous(), src=0, group=group.process_group)

    async def close(self) -> None:
        for url, group in self._groups.items():
            await self._engines[url].destroy_weights_update_group(group.name)
            dist.destroy_process_group(group.process_group)
        self._groups.clear()
