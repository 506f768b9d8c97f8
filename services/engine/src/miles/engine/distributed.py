"""The engine's side of SGLang's weight-update groups: /init_weights_update_group, the receiving half of
/update_weights_from_distributed, and /destroy_weights_update_group.

Why: a trainer that holds the weights updates its engines by broadcasting every tensor over a torch.distributed
group it shares with them (NCCL between GPUs), with no checkpoint file or HTTP payload in between. The group is
created with `miles.model.update_group.init_custom_process_group`, the function weight-sync's nccl transport
uses on the trainer side and the same construction as SGLang's, so a trainer meets this engine and SGLang alike.

Threads: creating a group blocks until every rank joined, and receiving blocks on each broadcast, so both run
in a thread of their own, never on the event loop nor on the scheduler thread: generation goes on while the
tensors arrive. The received tensors are validated and applied by the engine like any other update
(core.py). An operation that started keeps running to its end even when its HTTP request goes away: a
broadcast the trainer sends must be consumed, and a group that is joining must not be claimed twice.

Limits: one rank per engine (tensor-parallel size 1), so the engine's rank is `rank_offset`; rank 0 is the
broadcast source (the trainer). gloo on the CPU; nccl only where CUDA is available: an engine computing on a GPU
(`device: cuda`) receives on that GPU and keeps the tensors there for the swap; a CPU engine receives on the
receiving thread's current CUDA device and copies them to the CPU. One operation per group at a time (a second
one is refused). `timeout_s` bounds joining and each broadcast; after a failed broadcast the group's stream is
out of step: destroy it and create a new one, as with SGLang. torch is imported on first use, so a --fake-model
engine loads it only when a group is created; that import (seconds) runs in a thread, so the engine keeps
answering.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from miles.engine.errors import WeightUpdateError
from miles.engine.protocol import InitWeightsUpdateGroupBody
from miles.engine.weights import TensorSpec

T = TypeVar("T")
INIT_MESSAGE = "Succeeded to initialize custom process group."
DESTROY_MESSAGE = "Succeeded to destroy custom process group."


@dataclass
class _Group:
    name: str
    device: str
    """Where broadcasts land: "cpu" (gloo) or "cuda:N" (nccl)."""
    keep_on_device: bool
    """Hand the received tensors over where they landed (the engine computes there), else as CPU copies."""
    process_group: Any = None
    """None while the ranks are joining."""
    busy: bool = True
    """Joining, or receiving an update: no other operation may use the group."""


class UpdateGroups:
    """The weight-update groups this engine belongs to, by name."""

    def __init__(self, timeout_s: float, engine_device: str = "cpu") -> None:
        """`engine_device`: where the runner computes ("cpu" or "cuda:N", Runner.device)."""
        self.timeout_s = timeout_s
        self.engine_device = engine_device
        self._groups: dict[str, _Group] = {}
        self._running: set[asyncio.Task[Any]] = set()

    async def init(self, body: InitWeightsUpdateGroupBody) -> None:
        """Join the group as rank `rank_offset` (blocks until every rank joined); raises WeightUpdateError."""
        _check_init(body)
        # may import torch: seconds, never on the event loop
        device = await _in_thread(_device_for, body.backend, self.engine_device)
        if body.group_name in self._groups:
            raise WeightUpdateError(f"weight-update group {body.group_name!r} already exists (destroy it first)")
        group = self._groups[body.group_name] = _Group(body.group_name, device, device == self.engine_device)
        host = f"[{body.master_address}]" if ":" in body.master_address else body.master_address
        await self.run_to_completion(self._join(group, body, f"tcp://{host}:{body.master_port}"))

    async def _join(self, group: _Group, body: InitWeightsUpdateGroupBody, init_method: str) -> None:
        args = (body.backend, init_method, body.world_size, body.rank_offset, body.group_name, self.timeout_s)
        try:
            group.process_group = await _in_thread(_init_process_group, *args)
        except Exception as exc:
            del self._groups[group.name]
            raise WeightUpdateError(f"Failed to initialize custom process group: {exc}.") from exc
        group.busy = False

    def claim(self, name: str) -> _Group:
        """Reserve an existing, idle group for one update; `release` it afterwards."""
        group = self._groups.get(name)
        if group is None:
            raise WeightUpdateError(
                f"weight-update group {name!r} does not exist (POST /init_weights_update_group first)"
            )
        if group.busy:
            raise WeightUpdateError(f"weight-update group {name!r} is busy (joining, or receiving another update)")
        group.busy = True
        return group

    def release(self, group: _Group) -> None:
        group.busy = False

    async def receive(self, group: _Group, specs: list[TensorSpec]) -> dict[str, Any]:
        """Every announced tensor, broadcast by rank 0 in order, by name: on the engine's device when they landed
        there, else on the CPU."""
        try:
            return await _in_thread(_receive, group.process_group, specs, group.device, group.keep_on_device)
        except Exception as exc:
            raise WeightUpdateError(f"Failed to update parameter online: {exc}. No weight was changed.") from exc

    async def destroy(self, name: str) -> None:
        group = self._groups.get(name)
        if group is None:
            raise WeightUpdateError(f"The group to be destroyed does not exist: {name!r}.")
        if group.busy:
            raise WeightUpdateError(f"weight-update group {name!r} is busy (joining, or receiving an update)")
        del self._groups[name]
        try:
            await _in_thread(_destroy, group.process_group)
        except Exception as exc:
            raise WeightUpdateError(f"Failed to destroy custom process group: {exc}.") from exc

    async def run_to_completion(self, operation: Coroutine[Any, Any, T]) -> T:
        """Await `operation`, which keeps running to its end even if the caller is cancelled."""
        task = asyncio.ensure_future(operation)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return await asyncio.shield(task)


def _check_init(body: InitWeightsUpdateGroupBody) -> None:
    if not body.group_name:
        raise WeightUpdateError("group_name is empty")
    if not body.master_address or not 0 < body.master_port < 65536:
        raise WeightUpdateError(f"no rendezvous at {body.master_address!r}:{body.master_port}")
    if not 0 < body.rank_offset < body.world_size:
        raise WeightUpdateError(
            f"rank_offset {body.rank_offset} must be in [1, world_size) = [1, {body.world_size}): "
            "rank 0 is the trainer, this engine has one rank"
        )


def _device_for(backend: str, engine_device: str) -> str:
    """Where tensors are received: the CPU for gloo; for nccl the engine's GPU, or for a CPU engine the current
    CUDA device (NCCL moves GPU memory only)."""
    if backend == "gloo":
        return "cpu"
    if backend != "nccl":
        raise WeightUpdateError(f"backend {backend!r} is not supported: use 'gloo' (CPU) or 'nccl' (CUDA)")
    import torch

    if not torch.cuda.is_available():
        raise WeightUpdateError("backend 'nccl' needs CUDA, which this engine does not have: use backend 'gloo'")
    if engine_device.startswith("cuda"):
        return engine_device
    return f"cuda:{torch.cuda.current_device()}"


def _init_process_group(*args: Any) -> Any:
    # Imported here, in the joining thread: the first import loads torch (seconds) and must not stall the event loop.
    from miles.model.update_group import init_custom_process_group

    return init_custom_process_group(*args)


def _receive(process_group: Any, specs: list[TensorSpec], device: str, keep_on_device: bool) -> dict[str, Any]:
    import contextlib

    import torch
    import torch.distributed as dist

    received = {}
    # This thread's current CUDA device is not the engine's (torch keeps it per thread): guard it for NCCL.
    guard = torch.cuda.device(device) if device.startswith("cuda") else contextlib.nullcontext()
    with guard:
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
            dist.broadcast(tensor, src=0, group=process_group)
            received[spec.name] = tensor if keep_on_device else tensor.cpu()
    return received


def _destroy(process_group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(process_group)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call in a thread of its own (not the default executor, which it could hold for minutes)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except Exception as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="miles-engine-update-group", daemon=True).start()
    return await asyncio.wrap_future(future)
